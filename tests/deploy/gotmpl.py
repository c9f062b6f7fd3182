"""A small evaluator of the Go template subset the Helm chart uses, so that
the chart can be rendered here (there is no helm binary on the test
machines) and compared with the plain manifests of deploy/k8s.

It knows only: `{{ }}` with `-` trimming and `/* */` comments; if, with
(each with an optional else), range over lists, define, end; `$x :=` and
`$x =`; fields of `.`, `$` and variables; string, number and bool
literals; parentheses; pipes; and the functions in FUNCS. Anything else
is an error: the templates are meant to stay that simple, to be reviewed
by eye. A field that does not exist is an error too (Helm would render it
empty), so that a template naming a value missing from values.yaml fails.
"""

import json
import re

import yaml

ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)


class TemplateError(Exception):
    pass


class Missing(TemplateError):
    pass


# --- parsing --------------------------------------------------------------

def tokenize(src):
    """Text and actions, with Go's whitespace trimming applied."""
    out = []
    pos = 0
    trim_next = False
    for m in ACTION.finditer(src):
        text = src[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        out.append(("text", text))
        body = m.group(2).strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            out.append(("action", body))
        trim_next = bool(m.group(3))
        pos = m.end()
    text = src[pos:]
    out.append(("text", text.lstrip() if trim_next else text))
    return out


def parse(src):
    """The tree of `src`: a list of nodes; also the defines it holds."""
    tokens = tokenize(src)
    defines = {}

    def block(i, closers):
        nodes = []
        while i < len(tokens):
            kind, body = tokens[i]
            if kind == "text":
                if body:
                    nodes.append(("text", body))
                i += 1
                continue
            word = body.split(None, 1)[0] if body else ""
            rest = body[len(word):].strip()
            if word in closers:
                return nodes, i, word
            if word in ("if", "with", "range"):
                inner, i, closer = block(i + 1, ("end", "else"))
                other = []
                if closer == "else":
                    if tokens[i][1].strip() != "else":
                        raise TemplateError(f"unsupported {{{{ {tokens[i][1]} }}}}")
                    other, i, closer = block(i + 1, ("end",))
                nodes.append((word, rest, inner, other))
                i += 1
            elif word == "define":
                inner, i, _ = block(i + 1, ("end",))
                defines[json.loads(rest)] = inner
                i += 1
            elif word in ("end", "else", "block", "template", "break", "continue"):
                raise TemplateError(f"unexpected {{{{ {body} }}}}")
            else:
                m = re.fullmatch(r"(\$\w*)\s*(:?=)\s*(.+)", body, re.S)
                if m:
                    nodes.append(("assign", m.group(1), m.group(3)))
                else:
                    nodes.append(("action", body))
                i += 1
        if closers:
            raise TemplateError(f"missing {{{{ end }}}} (wanted one of {closers})")
        return nodes, i, None

    nodes, _, _ = block(0, ())
    return nodes, defines


EXPR_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>-?\d+)|(?P<lp>\()|(?P<rp>\))|(?P<pipe>\|)'
    r'|(?P<var>\$\w*(?:\.\w+)*)|(?P<field>(?:\.\w+)+|\.)|(?P<ident>\w+))'
)


def lex_expr(text):
    pos = 0
    out = []
    text = text.strip()
    while pos < len(text):
        m = EXPR_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot read {text[pos:]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


# --- evaluation -----------------------------------------------------------

def truthy(v):
    """Go's: false, 0, nil and empty strings, lists and maps are false."""
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, (int, float, str, list, dict)):
        return bool(v)
    return True


def to_yaml(v):
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def go_string(v):
    if v is None:
        raise TemplateError("a nil value printed")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise TemplateError(f"a map or list printed without toYaml: {v!r}")
    return str(v)


def _required(msg, v):
    if not truthy(v):
        raise TemplateError(f"required: {msg}")
    return v


def _fail(msg):
    raise TemplateError(f"fail: {msg}")


def _len(v):
    if not isinstance(v, (str, list, dict)):
        raise TemplateError(f"len of {v!r}")
    return len(v)


def _lt(a, b):
    if type(a) is not type(b) or not isinstance(a, (int, str)) or isinstance(a, bool):
        raise TemplateError(f"incomparable: {a!r} < {b!r}")
    return a < b


def _indent(n, s):
    return "\n".join(" " * n + line for line in go_string(s).split("\n"))


FUNCS = {
    "quote": lambda *vs: " ".join(json.dumps(go_string(v)) for v in vs),
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "indent": _indent,
    "toYaml": to_yaml,
    "default": lambda d, v=None: v if truthy(v) else d,
    "required": _required,
    "fail": _fail,
    "len": _len,
    "lt": _lt,
    "printf": lambda fmt, *args: re.sub(r"%[sdv]", "{}", fmt).format(*(go_string(a) for a in args)),
    "not": lambda v: not truthy(v),
    "and": lambda *vs: next((v for v in vs if not truthy(v)), vs[-1]),
    "or": lambda *vs: next((v for v in vs if truthy(v)), vs[-1]),
    "list": lambda *vs: list(vs),
    "append": lambda l, v: list(l) + [v],
}


class Renderer:
    def __init__(self, sources):
        """sources: {file name: template text}; defines are shared."""
        self.trees = {}
        self.defines = {}
        for name, src in sources.items():
            nodes, defines = parse(src)
            self.trees[name] = nodes
            self.defines.update(defines)

    def render(self, name, root):
        return self.run(self.trees[name], root, {"$": root})

    def run(self, nodes, dot, scope):
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "action":
                out.append(go_string(self.pipeline(node[1], dot, scope)))
            elif kind == "assign":
                scope[node[1]] = self.pipeline(node[2], dot, scope)
            elif kind in ("if", "with"):
                v = self.pipeline(node[1], dot, scope)
                if truthy(v):
                    out.append(self.run(node[2], v if kind == "with" else dot, scope))
                else:
                    out.append(self.run(node[3], dot, scope))
            elif kind == "range":
                v = self.pipeline(node[1], dot, scope)
                if not isinstance(v, list):
                    raise TemplateError("range over a non-list")
                for item in v:
                    out.append(self.run(node[2], item, scope))
                if not v:
                    out.append(self.run(node[3], dot, scope))
        return "".join(out)

    def field(self, base, path, what):
        for part in [p for p in path.split(".") if p]:
            if not isinstance(base, dict) or part not in base:
                raise Missing(f"{what}: no {part!r}")
            base = base[part]
        return base

    def pipeline(self, text, dot, scope):
        tokens = lex_expr(text)
        value, pos = self.parse_pipeline(tokens, 0, dot, scope)
        if pos != len(tokens):
            raise TemplateError(f"trailing tokens in {text!r}")
        return value

    def parse_pipeline(self, tokens, pos, dot, scope):
        first = True
        value = None
        while True:
            cmd = []
            while pos < len(tokens) and tokens[pos][0] not in ("pipe", "rp"):
                if tokens[pos][0] == "lp":
                    inner, pos = self.parse_pipeline(tokens, pos + 1, dot, scope)
                    if pos >= len(tokens) or tokens[pos][0] != "rp":
                        raise TemplateError("unbalanced parentheses")
                    cmd.append(("value", inner))
                else:
                    cmd.append(tokens[pos])
                pos += 1
            value = self.command(cmd, dot, scope, None if first else value, first)
            first = False
            if pos < len(tokens) and tokens[pos][0] == "pipe":
                pos += 1
                continue
            return value, pos

    def term(self, tok, dot, scope):
        kind, text = tok
        if kind == "value":
            return text
        if kind == "str":
            return json.loads(text)
        if kind == "num":
            return int(text)
        if kind == "field":
            return dot if text == "." else self.field(dot, text, text)
        if kind == "var":
            name, _, path = text.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            return self.field(scope[name], path, text)
        if kind == "ident" and text in ("true", "false"):
            return text == "true"
        raise TemplateError(f"cannot evaluate {text!r}")

    def command(self, cmd, dot, scope, piped, first):
        if not cmd:
            raise TemplateError("empty command")
        head = cmd[0]
        if head[0] == "ident" and head[1] not in ("true", "false"):
            args = [self.term(t, dot, scope) for t in cmd[1:]]
            if not first:
                args.append(piped)
            if head[1] == "include":
                name, data = args
                if name not in self.defines:
                    raise TemplateError(f"no template {name!r}")
                return self.run(self.defines[name], data, {"$": scope["$"]})
            if head[1] not in FUNCS:
                raise TemplateError(f"unknown function {head[1]!r}")
            return FUNCS[head[1]](*args)
        if len(cmd) != 1 or not first:
            raise TemplateError(f"a value cannot take arguments: {cmd!r}")
        return self.term(head, dot, scope)

//! The Dockerfile fragment a template build runs: RUN (shell and exec form),
//! COPY (`--chown=` and `--chmod=` optional), ENV (`k=v ...` and `k v`),
//! WORKDIR (any absolute directory but /proc, /sys and /dev), USER (`root`
//! or `user`: who runs the RUN steps after it and the startup command),
//! CMD, comments and line continuations. Everything else (FROM, ENTRYPOINT,
//! ADD, ARG, ...) is refused with the line that holds it, before anything
//! runs: a build always starts from the template's image.
//!
//! Variables are not expanded (`$X` in WORKDIR or COPY is refused rather
//! than taken literally); COPY takes no globs, URLs or paths out of the
//! build context. Pure code over text, so it is tested without a sandbox.

/// Largest Dockerfile accepted.
pub const MAX_DOCKERFILE: usize = 64 * 1024;
/// Most instructions in one Dockerfile.
pub const MAX_STEPS: usize = 256;

/// A command as RUN or CMD gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `RUN echo hi`: run by `/bin/sh -c`.
    Shell(String),
    /// `RUN ["echo", "hi"]`: executed directly.
    Exec(Vec<String>),
}

impl Command {
    /// As one shell command line (exec form quoted word by word).
    pub fn to_shell(&self) -> String {
        match self {
            Command::Shell(s) => s.clone(),
            Command::Exec(argv) => argv.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" "),
        }
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    Run(Command),
    Copy {
        /// Relative to the context's root, normalized; "" is the root itself.
        sources: Vec<String>,
        /// As written (absolute, or relative to the WORKDIR).
        dest: String,
        /// Image ids; root when absent.
        chown: Option<(u32, u32)>,
        /// Mode of every file and directory copied; theirs when absent.
        chmod: Option<u32>,
    },
    Env(Vec<(String, String)>),
    /// As written; see [`resolve_workdir`].
    Workdir(String),
    /// `root` or `user`.
    User(String),
    Cmd(Command),
}

/// One instruction and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Line number (1-based) of its first line.
    pub line: usize,
    /// The instruction as one line, continuations joined.
    pub text: String,
    pub instruction: Instruction,
}

/// Why a Dockerfile is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Dockerfile line {line}: {message}")]
pub struct Refused {
    pub line: usize,
    pub message: String,
}

fn refuse<T>(line: usize, message: impl Into<String>) -> Result<T, Refused> {
    Err(Refused { line, message: message.into() })
}

/// Parses a whole Dockerfile; the first problem refuses it.
pub fn parse(text: &str) -> Result<Vec<Step>, Refused> {
    if text.len() > MAX_DOCKERFILE {
        return refuse(1, format!("the Dockerfile is larger than {MAX_DOCKERFILE} bytes"));
    }
    if text.contains('\0') {
        return refuse(1, "the Dockerfile holds a NUL byte");
    }
    let mut steps = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim();
        // Comments and blank lines are skipped, inside continuations too.
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let (body, continues) = match trimmed.strip_suffix('\\') {
            Some(b) => (b.trim_end(), true),
            None => (trimmed, false),
        };
        let (start, mut joined) = current.take().unwrap_or((n, String::new()));
        if !joined.is_empty() {
            joined.push(' ');
        }
        joined.push_str(body);
        if continues {
            current = Some((start, joined));
            continue;
        }
        steps.push(instruction(start, joined)?);
        if steps.len() > MAX_STEPS {
            return refuse(n, format!("more than {MAX_STEPS} instructions"));
        }
    }
    if let Some((start, joined)) = current {
        steps.push(instruction(start, joined)?);
    }
    if steps.is_empty() {
        return refuse(1, "the Dockerfile holds no instruction");
    }
    Ok(steps)
}

fn instruction(line: usize, text: String) -> Result<Step, Refused> {
    let (word, rest) = match text.split_once(char::is_whitespace) {
        Some((w, r)) => (w, r.trim()),
        None => (text.as_str(), ""),
    };
    let keyword = word.to_ascii_uppercase();
    let instruction = match keyword.as_str() {
        "RUN" => Instruction::Run(command(line, "RUN", rest)?),
        "CMD" => Instruction::Cmd(command(line, "CMD", rest)?),
        "COPY" => copy(line, rest)?,
        "ENV" => Instruction::Env(env(line, rest)?),
        "WORKDIR" => Instruction::Workdir(workdir_arg(line, rest)?),
        "FROM" => return refuse(line, "FROM is not supported: a build always starts from the template's image"),
        "ENTRYPOINT" => return refuse(line, "ENTRYPOINT is not supported: use CMD for the startup command"),
        "USER" => Instruction::User(user_arg(line, rest)?),
        "ADD" => return refuse(line, "ADD is not supported: use COPY (no URLs, no archives unpacked)"),
        _ => return refuse(line, format!("{word} is not supported (only RUN, COPY, ENV, WORKDIR, USER and CMD are)")),
    };
    Ok(Step { line, text, instruction })
}

fn command(line: usize, what: &str, rest: &str) -> Result<Command, Refused> {
    if rest.starts_with("--") {
        return refuse(line, format!("{what} takes no flags"));
    }
    if rest.starts_with('[') {
        return match serde_json::from_str::<Vec<String>>(rest) {
            Ok(argv) if !argv.is_empty() && argv.iter().all(|a| !a.contains('\0')) => Ok(Command::Exec(argv)),
            Ok(_) => refuse(line, format!("{what} with an empty JSON array")),
            Err(_) => refuse(line, format!("{what} [...] must be a JSON array of strings")),
        };
    }
    if rest.is_empty() {
        return refuse(line, format!("{what} needs a command"));
    }
    Ok(Command::Shell(rest.to_owned()))
}

/// Splits on whitespace, honouring double and single quotes and backslash
/// escapes (outside single quotes).
fn words(line: usize, s: &str) -> Result<Vec<String>, Refused> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => cur.push(c),
            (_, '\\') => match chars.next() {
                Some(n) => cur.push(n),
                None => return refuse(line, "a trailing backslash"),
            },
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return refuse(line, "an unterminated quote");
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

fn env_key_ok(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 256
        && !k.as_bytes()[0].is_ascii_digit()
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn env(line: usize, rest: &str) -> Result<Vec<(String, String)>, Refused> {
    let first = rest.split_whitespace().next().unwrap_or("");
    let pairs = if first.contains('=') {
        let mut pairs = Vec::new();
        for w in words(line, rest)? {
            let Some((k, v)) = w.split_once('=') else {
                return refuse(line, format!("ENV {w:?}: expected KEY=VALUE"));
            };
            pairs.push((k.to_owned(), v.to_owned()));
        }
        pairs
    } else {
        // The old form: ENV KEY the rest of the line.
        match rest.split_once(char::is_whitespace) {
            Some((k, v)) => vec![(k.to_owned(), v.trim().to_owned())],
            None => return refuse(line, "ENV needs KEY=VALUE or KEY VALUE"),
        }
    };
    for (k, v) in &pairs {
        if !env_key_ok(k) {
            return refuse(line, format!("ENV name {k:?}: use letters, digits and _"));
        }
        if v.len() > 32 * 1024 {
            return refuse(line, format!("ENV {k}: value longer than 32 KiB"));
        }
    }
    Ok(pairs)
}

fn no_variables(line: usize, what: &str, s: &str) -> Result<(), Refused> {
    if s.contains('$') {
        return refuse(line, format!("{what} {s:?}: variables are not expanded"));
    }
    Ok(())
}

fn workdir_arg(line: usize, rest: &str) -> Result<String, Refused> {
    let w = words(line, rest)?;
    let [dir] = w.as_slice() else { return refuse(line, "WORKDIR takes one path") };
    no_variables(line, "WORKDIR", dir)?;
    Ok(dir.clone())
}

/// Trees a WORKDIR may not name: the kernel's, mounted over the image.
const NO_WORKDIR: &[&str] = &["/proc", "/sys", "/dev"];

/// Where a WORKDIR lands from the current one; refused for the root itself
/// and inside /proc, /sys and /dev.
pub fn resolve_workdir(line: usize, current: &str, dir: &str) -> Result<String, Refused> {
    let path = absolute(current, dir).ok_or_else(|| Refused { line, message: format!("WORKDIR {dir:?}: bad path") })?;
    if path == "/" {
        return refuse(line, format!("WORKDIR {dir:?}: the root directory is not a working directory"));
    }
    if NO_WORKDIR.iter().any(|n| path == *n || path.strip_prefix(n).is_some_and(|r| r.starts_with('/'))) {
        return refuse(line, format!("WORKDIR {dir:?} is inside /proc, /sys or /dev"));
    }
    Ok(path)
}

/// USER: the users every image has.
fn user_arg(line: usize, rest: &str) -> Result<String, Refused> {
    match rest {
        "root" | "user" => Ok(rest.to_owned()),
        "0" | "0:0" | "root:root" => Ok("root".into()),
        "1000" | "1000:1000" | "user:user" => Ok("user".into()),
        _ => refuse(line, format!("USER {rest:?} is not supported: use root or user")),
    }
}

/// `dir` made absolute against `cwd` and normalized; None when `..` would
/// climb above the root or the path holds NUL.
pub fn absolute(cwd: &str, dir: &str) -> Option<String> {
    if dir.contains('\0') {
        return None;
    }
    let joined = if dir.starts_with('/') { dir.to_owned() } else { format!("{cwd}/{dir}") };
    let mut parts: Vec<&str> = Vec::new();
    for p in joined.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(format!("/{}", parts.join("/")))
}

fn copy(line: usize, rest: &str) -> Result<Instruction, Refused> {
    let mut chown = None;
    let mut chmod = None;
    let mut rest = rest;
    while let Some(flag) = rest.strip_prefix("--") {
        let (flag, after) = flag.split_once(char::is_whitespace).unwrap_or((flag, ""));
        match flag.split_once('=') {
            Some(("chown", v)) => chown = Some(parse_chown(line, v)?),
            Some(("chmod", v)) => match u32::from_str_radix(v, 8) {
                Ok(m) if !v.is_empty() && v.len() <= 4 && m <= 0o7777 => chmod = Some(m),
                _ => return refuse(line, format!("COPY --chmod={v}: use an octal mode such as 0644")),
            },
            _ => return refuse(line, format!("COPY --{flag} is not supported (only --chown= and --chmod=)")),
        }
        rest = after.trim_start();
    }
    let args: Vec<String> = if rest.starts_with('[') {
        serde_json::from_str(rest).map_err(|_| Refused { line, message: "COPY [...] must be a JSON array".into() })?
    } else {
        words(line, rest)?
    };
    let Some((dest, sources)) = args.split_last() else { return refuse(line, "COPY needs a source and a destination") };
    if sources.is_empty() {
        return refuse(line, "COPY needs a source and a destination");
    }
    no_variables(line, "COPY", dest)?;
    let mut norm = Vec::new();
    for s in sources {
        no_variables(line, "COPY", s)?;
        if s.contains("://") || s.starts_with("git@") {
            return refuse(line, format!("COPY {s:?}: URLs are not supported; put the file in the build context"));
        }
        if s.contains(['*', '?', '[']) {
            return refuse(line, format!("COPY {s:?}: patterns are not supported; name files and directories"));
        }
        let mut parts = Vec::new();
        for p in s.split('/') {
            match p {
                "" | "." => {}
                ".." => return refuse(line, format!("COPY {s:?} leaves the build context")),
                p => parts.push(p),
            }
        }
        norm.push(parts.join("/"));
    }
    Ok(Instruction::Copy { sources: norm, dest: dest.clone(), chown, chmod })
}

/// `--chown=` as numeric ids or the names every image has (root, user).
fn parse_chown(line: usize, v: &str) -> Result<(u32, u32), Refused> {
    let id = |s: &str| -> Result<u32, Refused> {
        match s {
            "root" => Ok(0),
            "user" => Ok(1000),
            "nobody" | "nogroup" => Ok(65534),
            n => match n.parse::<u32>() {
                Ok(n) if n < 65536 => Ok(n),
                _ => refuse(line, format!("--chown={v}: use root, user, or ids below 65536")),
            },
        }
    };
    match v.split_once(':') {
        Some((u, g)) => Ok((id(u)?, id(g)?)),
        None => {
            let u = id(v)?;
            Ok((u, u))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fragment_parses() {
        let text = "# a comment\n\
            RUN apt-get update && \\\n    # inside a continuation\n    echo done\n\
            run [\"echo\", \"exec form\"]\n\
            COPY --chown=user:user app.py ./lib/ /workspace/app/\n\
            COPY . /opt/ctx\n\
            ENV A=1 B=\"two words\" C='$literal'\n\
            ENV OLD the rest of it\n\
            WORKDIR /workspace/app\n\
            CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n";
        let steps = parse(text).expect("parse");
        let kinds: Vec<&Instruction> = steps.iter().map(|s| &s.instruction).collect();
        assert_eq!(steps[0].line, 2);
        assert_eq!(*kinds[0], Instruction::Run(Command::Shell("apt-get update && echo done".into())));
        assert_eq!(*kinds[1], Instruction::Run(Command::Exec(vec!["echo".into(), "exec form".into()])));
        assert_eq!(
            *kinds[2],
            Instruction::Copy {
                sources: vec!["app.py".into(), "lib".into()],
                dest: "/workspace/app/".into(),
                chown: Some((1000, 1000)),
                chmod: None,
            }
        );
        assert_eq!(
            *kinds[3],
            Instruction::Copy { sources: vec!["".into()], dest: "/opt/ctx".into(), chown: None, chmod: None }
        );
        assert_eq!(
            *kinds[4],
            Instruction::Env(vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "$literal".into())
            ])
        );
        assert_eq!(*kinds[5], Instruction::Env(vec![("OLD".into(), "the rest of it".into())]));
        assert_eq!(*kinds[6], Instruction::Workdir("/workspace/app".into()));
        let Instruction::Cmd(cmd) = kinds[7] else { panic!("CMD") };
        assert_eq!(cmd.to_shell(), "python3 -m http.server 8000");
        assert_eq!(Command::Exec(vec!["echo".into(), "it's".into()]).to_shell(), r"echo 'it'\''s'");
    }

    #[test]
    fn user_and_chmod_parse() {
        let steps = parse("USER root\nCOPY --chmod=0750 --chown=user a /b\nUSER 1000\n").expect("parse");
        assert_eq!(steps[0].instruction, Instruction::User("root".into()));
        assert_eq!(
            steps[1].instruction,
            Instruction::Copy {
                sources: vec!["a".into()],
                dest: "/b".into(),
                chown: Some((1000, 1000)),
                chmod: Some(0o750)
            }
        );
        assert_eq!(steps[2].instruction, Instruction::User("user".into()));
    }

    #[test]
    fn other_instructions_are_refused_with_their_line() {
        for (text, line, word) in [
            ("RUN true\nFROM debian\n", 2, "FROM"),
            ("ENTRYPOINT [\"x\"]", 1, "ENTRYPOINT"),
            ("RUN true\n\nUSER nobody", 3, "USER"),
            ("COPY --chmod=999 a /b", 1, "chmod"),
            ("ADD https://example.com/x /x", 1, "ADD"),
            ("ARG X=1", 1, "ARG"),
            ("EXPOSE 80", 1, "EXPOSE"),
        ] {
            let e = parse(text).expect_err(text);
            assert_eq!(e.line, line, "{text}");
            assert!(e.message.contains(word), "{e}");
        }
    }

    #[test]
    fn copy_and_workdir_stay_inside_their_bounds() {
        for bad in [
            "COPY ../secret /x",
            "COPY a/../../b /x",
            "COPY https://example.com/x /x",
            "COPY *.py /x",
            "COPY --from=build /a /b",
            "COPY onlyone",
            "COPY $HOME /x",
            "WORKDIR $X",
            "WORKDIR a b",
            "RUN --mount=type=cache true",
            "RUN",
            "RUN []",
            "ENV",
            "ENV 1BAD=x",
            "ENV A=\"unterminated",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(resolve_workdir(1, "/workspace", "app/../lib").expect("ok"), "/workspace/lib");
        assert_eq!(resolve_workdir(1, "/workspace/a", "/workspace").expect("ok"), "/workspace");
        assert!(resolve_workdir(1, "/workspace", "..").is_err());
        assert_eq!(resolve_workdir(1, "/workspace", "/opt/app").expect("ok"), "/opt/app");
        assert_eq!(resolve_workdir(1, "/workspace", "/procs").expect("ok"), "/procs");
        for bad in ["/proc", "/proc/1", "/sys/x", "/dev", "/"] {
            assert!(resolve_workdir(1, "/workspace", bad).is_err(), "{bad}");
        }
        assert_eq!(absolute("/", "../.."), None);
        assert!(parse(&"RUN true\n".repeat(MAX_STEPS + 1)).is_err());
        assert!(parse("# only a comment\n").is_err());
    }
}

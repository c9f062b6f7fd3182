//! Dockerfile fragments of template builds (hutch-control's build
//! dockerfile `parse`): every instruction it accepts keeps the promises the
//! build relies on (COPY sources inside the context, WORKDIR never in
//! /proc, /sys or /dev, USER root or user, ENV names a shell takes, bounded
//! counts and sizes), and refusals name a line of the text.
#![no_main]

use hutch_control::build::dockerfile::{self, Command, Instruction, MAX_STEPS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let lines = text.lines().count().max(1);
    let steps = match dockerfile::parse(text) {
        Ok(steps) => steps,
        Err(refused) => {
            assert!(refused.line >= 1 && refused.line <= lines, "line {} of {lines}", refused.line);
            return;
        }
    };
    assert!(!steps.is_empty() && steps.len() <= MAX_STEPS);
    let mut previous = 0;
    let mut workdir = "/workspace".to_owned();
    for step in &steps {
        assert!(step.line > previous && step.line <= lines);
        previous = step.line;
        assert!(!step.text.contains('\n'));
        match &step.instruction {
            Instruction::Run(c) | Instruction::Cmd(c) => {
                match c {
                    Command::Shell(s) => assert!(!s.is_empty()),
                    Command::Exec(argv) => assert!(!argv.is_empty() && argv.iter().all(|a| !a.contains('\0'))),
                }
                let _ = c.to_shell();
            }
            Instruction::Copy { sources, dest, chown, chmod } => {
                assert!(chmod.is_none_or(|m| m <= 0o7777));
                assert!(!sources.is_empty() && !dest.contains('$'));
                for s in sources {
                    assert!(!s.contains('$') && !s.contains("://") && !s.contains(['*', '?', '[']));
                    if !s.is_empty() {
                        assert!(s.split('/').all(|p| !p.is_empty() && p != "." && p != ".."), "{s:?}");
                    }
                }
                if let Some((u, g)) = chown {
                    assert!(*u < 65536 && *g < 65536);
                }
            }
            Instruction::Env(pairs) => {
                for (k, v) in pairs {
                    assert!(!k.is_empty() && !k.as_bytes()[0].is_ascii_digit());
                    assert!(k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
                    assert!(v.len() <= 32 * 1024);
                }
            }
            Instruction::User(u) => assert!(u == "root" || u == "user", "{u:?}"),
            Instruction::Workdir(dir) => {
                assert!(!dir.contains('$'));
                if let Ok(path) = dockerfile::resolve_workdir(step.line, &workdir, dir) {
                    for kernel in ["/proc", "/sys", "/dev"] {
                        assert!(path != kernel && !path.starts_with(&format!("{kernel}/")), "{path:?}");
                    }
                    assert_ne!(path, "/");
                    normalized(&path);
                    workdir = path;
                }
            }
        }
    }
});

/// An absolute, normalized path: what `absolute` makes of it is itself.
fn normalized(path: &str) {
    assert!(path.starts_with('/'));
    assert!(path == "/" || path[1..].split('/').all(|p| !p.is_empty() && p != "." && p != ".."), "{path:?}");
    assert_eq!(dockerfile::absolute("/", path).as_deref(), Some(path));
}

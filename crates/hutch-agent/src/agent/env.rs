//! The environment and executable path of a spawned process: validation of
//! variables, the per-user defaults, and the `PATH` search.

use super::users::User;

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A variable is valid when its key is non-empty without `=` or NUL and its
/// value holds no NUL.
pub fn check_var(key: &str, value: &str) -> Result<(), String> {
    if key.is_empty() || key.contains('=') || key.contains('\0') {
        return Err(format!("invalid environment variable name {key:?}"));
    }
    if value.contains('\0') {
        return Err(format!("environment variable {key} holds a NUL byte"));
    }
    Ok(())
}

fn set(env: &mut Vec<(String, String)>, key: &str, value: &str) {
    match env.iter_mut().find(|(k, _)| k == key) {
        Some(entry) => entry.1 = value.to_string(),
        None => env.push((key.to_string(), value.to_string())),
    }
}

fn set_default(env: &mut Vec<(String, String)>, key: &str, value: &str) {
    if !env.iter().any(|(k, _)| k == key) {
        env.push((key.to_string(), value.to_string()));
    }
}

/// The sandbox environment, then the defaults for `user` where unset, then
/// the request's variables, which win.
pub fn build(
    sandbox: &[(String, String)],
    user: &User,
    pty: bool,
    request: &[(String, String)],
) -> Result<Vec<(String, String)>, String> {
    for (k, v) in request {
        check_var(k, v)?;
    }
    let mut env = Vec::with_capacity(sandbox.len() + request.len() + 8);
    for (k, v) in sandbox {
        set(&mut env, k, v);
    }
    set_default(&mut env, "PATH", DEFAULT_PATH);
    set_default(&mut env, "HOME", &user.home);
    set_default(&mut env, "USER", &user.name);
    set_default(&mut env, "LOGNAME", &user.name);
    set_default(&mut env, "SHELL", &user.shell);
    set_default(&mut env, "LANG", "C.UTF-8");
    if pty {
        set_default(&mut env, "TERM", "xterm-256color");
    }
    for (k, v) in request {
        set(&mut env, k, v);
    }
    Ok(env)
}

/// Where `execvp` would find `cmd`: `cmd` itself when it holds a slash, else
/// the first executable candidate in `path_var` (empty entries meaning the
/// working directory, relative entries resolved against `cwd`).
pub fn search_path(
    cmd: &str,
    path_var: Option<&str>,
    cwd: &str,
    is_executable: impl Fn(&str) -> bool,
) -> Option<String> {
    if cmd.contains('/') {
        return Some(cmd.to_string());
    }
    if cmd.is_empty() {
        return None;
    }
    for dir in path_var.unwrap_or(DEFAULT_PATH).split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let candidate = if dir.starts_with('/') {
            format!("{}/{cmd}", dir.trim_end_matches('/'))
        } else {
            format!("{}/{dir}/{cmd}", cwd.trim_end_matches('/'))
        };
        if is_executable(&candidate) {
            return Some(candidate);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> User {
        User { name: "u".into(), uid: 1000, gid: 1000, home: "/home/u".into(), shell: "/bin/zsh".into() }
    }

    fn get<'a>(env: &'a [(String, String)], k: &str) -> Option<&'a str> {
        env.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn env_layers_sandbox_then_defaults_then_request() {
        let sandbox = vec![("PATH".into(), "/opt/bin".into()), ("A".into(), "sandbox".into())];
        let request = vec![("A".into(), "request".into()), ("HOME".into(), "/elsewhere".into())];
        let env = build(&sandbox, &user(), false, &request).expect("valid");
        assert_eq!(get(&env, "PATH"), Some("/opt/bin"));
        assert_eq!(get(&env, "A"), Some("request"));
        assert_eq!(get(&env, "HOME"), Some("/elsewhere"));
        assert_eq!(get(&env, "USER"), Some("u"));
        assert_eq!(get(&env, "LOGNAME"), Some("u"));
        assert_eq!(get(&env, "SHELL"), Some("/bin/zsh"));
        assert_eq!(get(&env, "LANG"), Some("C.UTF-8"));
        assert_eq!(get(&env, "TERM"), None, "TERM only with a pty");
        assert_eq!(env.iter().filter(|(k, _)| k == "A").count(), 1);
        let env = build(&[], &user(), true, &[]).expect("valid");
        assert_eq!(get(&env, "TERM"), Some("xterm-256color"));
        assert_eq!(get(&env, "PATH"), Some(DEFAULT_PATH));
    }

    #[test]
    fn env_refuses_bad_keys_and_values() {
        for (k, v) in [("", "x"), ("A=B", "x"), ("A\0", "x"), ("A", "x\0y")] {
            assert!(build(&[], &user(), false, &[(k.into(), v.into())]).is_err(), "{k:?}={v:?}");
        }
    }

    #[test]
    fn path_search_finds_first_executable() {
        let exists = |p: &str| p == "/usr/bin/ls" || p == "/bin/ls" || p == "/w/./tool";
        assert_eq!(search_path("ls", Some("/nope:/usr/bin/:/bin"), "/", exists).as_deref(), Some("/usr/bin/ls"));
        assert_eq!(search_path("tool", Some("/bin::/x"), "/w", exists).as_deref(), Some("/w/./tool"));
        assert_eq!(search_path("missing", None, "/", exists), None);
        assert_eq!(search_path("./rel/x", None, "/", exists).as_deref(), Some("./rel/x"));
        assert_eq!(search_path("", None, "/", exists), None);
    }
}

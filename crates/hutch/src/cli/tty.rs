//! `hutch exec -it`: an interactive terminal in a sandbox, through the
//! daemon's `GET /v1/sandboxes/{id}/pty` WebSocket.
//!
//! The local terminal goes to raw mode for the session and back on every
//! way out: a normal end, an error, a panic (a hook), and SIGTERM, SIGHUP
//! or SIGINT sent to hutch (their handlers only write to a pipe the loop
//! watches). One thread polls stdin, the socket and that pipe: typed bytes
//! go out as binary frames, a SIGWINCH as a resize message, and the
//! terminal's bytes to stdout. hutch exits with the command's exit code.
//! An `https://` daemon is reached over `wss://` (rustls, Mozilla's roots,
//! as ureq does for the other commands).

use super::exec::EXIT_HUTCH;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

type Socket = tungstenite::WebSocket<Stream>;

/// The connection under the WebSocket: plain (`http://` daemons) or TLS
/// (`https://`, verified against Mozilla's roots as the rest of the CLI).
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &s.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

fn tls(host: &str, tcp: TcpStream) -> anyhow::Result<Stream> {
    let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    let config = rustls::ClientConfig::builder_with_provider(rustls::crypto::ring::default_provider().into())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())?;
    let conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name)?;
    Ok(Stream::Tls(Box::new(rustls::StreamOwned::new(conn, tcp))))
}

/// What to run and how, from `hutch exec` flags.
pub struct TtyRequest<'a> {
    pub id: &'a str,
    /// A shell command line; the login shell when absent.
    pub command: Option<String>,
    pub user: Option<&'a str>,
    pub cwd: Option<&'a str>,
    pub env: Vec<(String, String)>,
}

/// The terminal's mode before hutch changed it, for every way out.
static SAVED: Mutex<Option<libc::termios>> = Mutex::new(None);
/// The write end of the signal pipe (-1 before it exists).
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

fn restore() {
    let saved = SAVED.lock().map(|mut s| s.take()).unwrap_or_else(|p| p.into_inner().take());
    if let Some(t) = saved {
        // SAFETY: fd 0 and a termios read from it by tcgetattr.
        unsafe { libc::tcsetattr(0, libc::TCSADRAIN, &t) };
    }
}

/// Raw mode until dropped (or until any exit path calls `restore`).
struct RawMode;

impl RawMode {
    fn enter() -> io::Result<RawMode> {
        // SAFETY: termios is plain data; tcgetattr fills it.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 and a valid termios pointer.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        *SAVED.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            hook(info);
        }));
        let mut raw = t;
        // SAFETY: a valid termios.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: fd 0 and a valid termios.
        if unsafe { libc::tcsetattr(0, libc::TCSADRAIN, &raw) } != 0 {
            let e = io::Error::last_os_error();
            restore();
            return Err(e);
        }
        Ok(RawMode)
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore();
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) is async-signal-safe; a one-byte buffer.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

/// The signal pipe's read end, with handlers for the signals it carries.
fn signal_pipe() -> io::Result<RawFd> {
    let mut fds = [0; 2];
    // SAFETY: a two-int array for pipe2.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    SIGNAL_PIPE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGWINCH, libc::SIGTERM, libc::SIGHUP, libc::SIGINT, libc::SIGQUIT] {
        // SAFETY: sigaction is plain data; the handler only writes to a pipe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    Ok(fds[0])
}

/// The local terminal's size (80x24 when it has none).
fn window_size() -> (u16, u16) {
    // SAFETY: winsize is plain data; TIOCGWINSZ fills it.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    for fd in [0, 1] {
        // SAFETY: a valid winsize pointer.
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_col > 0 && ws.ws_row > 0 {
            return (ws.ws_col.min(1000), ws.ws_row.min(1000));
        }
    }
    (80, 24)
}

/// Whether fd 0 is a terminal.
pub fn stdin_is_tty() -> bool {
    // SAFETY: isatty takes any fd.
    unsafe { libc::isatty(0) == 1 }
}

/// A command line of words for `/bin/sh -c`, each quoted; `exec` so that
/// the program is the terminal's process.
pub fn shell_line(words: &[String]) -> String {
    let quoted: Vec<String> = words
        .iter()
        .map(|w| {
            if !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b)) {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect();
    format!("exec {}", quoted.join(" "))
}

/// The WebSocket URL of the terminal route, with its query.
fn url(base: &str, req: &TtyRequest, cols: u16, rows: u16) -> anyhow::Result<String> {
    let (scheme, rest) = match base.split_once("://") {
        Some(("http", rest)) => ("ws", rest),
        Some(("https", rest)) => ("wss", rest),
        _ => anyhow::bail!("the daemon URL {base} is neither http:// nor https://"),
    };
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("cols", &cols.to_string()).append_pair("rows", &rows.to_string());
    if let Some(c) = &req.command {
        q.append_pair("command", c);
    }
    if let Some(u) = req.user {
        q.append_pair("user", u);
    }
    if let Some(c) = req.cwd {
        q.append_pair("cwd", c);
    }
    for (k, v) in &req.env {
        q.append_pair("env", &format!("{k}={v}"));
    }
    let id: String = form_urlencoded::byte_serialize(req.id.as_bytes()).collect();
    Ok(format!("{scheme}://{}/v1/sandboxes/{id}/pty?{}", rest.trim_end_matches('/'), q.finish()))
}

/// Opens the terminal; refusals come back as the API's errors.
fn connect(url: &str, key: &str) -> anyhow::Result<Socket> {
    use tungstenite::client::IntoClientRequest;
    let mut request = url.into_client_request()?;
    request.headers_mut().insert("Authorization", format!("Bearer {key}").parse()?);
    request.headers_mut().insert("Sec-WebSocket-Protocol", "hutch.pty".parse()?);
    let secure = request.uri().scheme_str() == Some("wss");
    // An IPv6 literal comes bracketed.
    let host = request.uri().host().unwrap_or("").trim_start_matches('[').trim_end_matches(']').to_owned();
    let port = request.uri().port_u16().unwrap_or(if secure { 443 } else { 80 });
    let tcp = TcpStream::connect((host.as_str(), port))
        .map_err(|e| anyhow::anyhow!("cannot reach the hutch daemon at {host}:{port}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let stream = if secure { tls(&host, tcp)? } else { Stream::Plain(tcp) };
    match tungstenite::client::client(request, stream) {
        Ok((socket, _)) => Ok(socket),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let body = resp.body().as_deref().unwrap_or_default();
            match serde_json::from_slice::<serde_json::Value>(body) {
                Ok(v) => {
                    let text = |k: &str| v.get(k).and_then(serde_json::Value::as_str).unwrap_or("").to_owned();
                    anyhow::bail!("{} ({})", text("error"), text("code"))
                }
                Err(_) => anyhow::bail!("HTTP {} from {url}", resp.status()),
            }
        }
        Err(e) => anyhow::bail!("opening the terminal at {url}: {e}"),
    }
}

/// Runs the terminal; the command's exit code.
pub fn run(base: &str, key: &str, req: &TtyRequest) -> anyhow::Result<i32> {
    if !stdin_is_tty() {
        anyhow::bail!("the input device is not a terminal: -t needs one (use -i alone to pipe input)");
    }
    let (cols, rows) = window_size();
    let url = url(base, req, cols, rows)?;
    let mut socket = connect(&url, key)?;
    let signals = signal_pipe()?;
    let raw = RawMode::enter()?;
    let result = session(&mut socket, signals);
    drop(raw);
    let _ = socket.close(None);
    let _ = socket.flush();
    match result? {
        End::Exit(code) => Ok(code),
        End::Signal(sig) => Ok(128 + sig),
        End::Error(message) => {
            eprintln!("hutch: {message}");
            Ok(EXIT_HUTCH)
        }
    }
}

enum End {
    Exit(i32),
    Signal(i32),
    Error(String),
}

fn would_block(e: &tungstenite::Error) -> bool {
    matches!(e, tungstenite::Error::Io(e) if e.kind() == io::ErrorKind::WouldBlock)
}

fn session(socket: &mut Socket, signals: RawFd) -> anyhow::Result<End> {
    use tungstenite::Message;
    socket.get_ref().tcp().set_nonblocking(true)?;
    let sock_fd = socket.get_ref().tcp().as_raw_fd();
    let mut stdout = io::stdout().lock();
    let mut stdin_open = true;
    let mut buf = vec![0u8; 32 << 10];
    let mut exit: Option<i32> = None;
    loop {
        // Frames already read into tungstenite's buffer first.
        loop {
            match socket.read() {
                Ok(Message::Binary(data)) => {
                    stdout.write_all(&data)?;
                    stdout.flush()?;
                }
                Ok(Message::Text(t)) => {
                    let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap_or_default();
                    let text = |k: &str| v.get(k).and_then(serde_json::Value::as_str).unwrap_or("").to_owned();
                    match text("type").as_str() {
                        "exit" => exit = v.get("exit_code").and_then(serde_json::Value::as_i64).map(|c| c as i32),
                        "error" => {
                            let _ = write!(io::stderr(), "\r\nhutch: {} ({})\r\n", text("error"), text("code"));
                        }
                        _ => {}
                    }
                }
                Ok(Message::Close(_)) => {}
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                    return Ok(match exit {
                        Some(c) => End::Exit(super::exec::exit_code(c)),
                        None => End::Error("the terminal's connection closed before the command exited".into()),
                    });
                }
                Err(e) => {
                    return Ok(match exit {
                        Some(c) => End::Exit(super::exec::exit_code(c)),
                        None => End::Error(format!("the terminal's connection broke: {e}")),
                    })
                }
            }
        }
        let pending = match socket.flush() {
            Ok(()) => false,
            Err(e) if would_block(&e) => true,
            Err(e) => return Ok(End::Error(format!("the terminal's connection broke: {e}"))),
        };
        let mut fds = [
            libc::pollfd { fd: sock_fd, events: libc::POLLIN | if pending { libc::POLLOUT } else { 0 }, revents: 0 },
            libc::pollfd { fd: signals, events: libc::POLLIN, revents: 0 },
            // Not read while a frame waits to go out: typing stalls, not memory.
            libc::pollfd { fd: if stdin_open && !pending { 0 } else { -1 }, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: three valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        // Always drained (the pipe does not block): a signal whose handler
        // ran as poll returned for stdin is handled before the bytes typed
        // after it.
        {
            let mut sigs = [0u8; 16];
            // SAFETY: reading into a local buffer from our pipe.
            let got = unsafe { libc::read(signals, sigs.as_mut_ptr().cast(), sigs.len()) };
            for &s in &sigs[..got.max(0) as usize] {
                match i32::from(s) {
                    libc::SIGWINCH => {
                        let (cols, rows) = window_size();
                        let msg = serde_json::json!({"type": "resize", "cols": cols, "rows": rows});
                        queue(socket, Message::Text(msg.to_string().into()))?;
                    }
                    // Sent to hutch itself: the terminal closes (and its
                    // command is killed by the daemon).
                    sig => return Ok(End::Signal(sig)),
                }
            }
        }
        if fds[2].revents != 0 {
            let n = match io::stdin().lock().read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => 0,
            };
            if n == 0 {
                stdin_open = false;
            } else {
                queue(socket, Message::Binary(buf[..n].to_vec().into()))?;
            }
        }
    }
}

/// Queues a frame; it goes out with the next flush.
fn queue(socket: &mut Socket, msg: tungstenite::Message) -> anyhow::Result<()> {
    match socket.write(msg) {
        Ok(()) => Ok(()),
        Err(e) if would_block(&e) => Ok(()),
        Err(e) => Err(anyhow::anyhow!("the terminal's connection broke: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_become_one_quoted_exec_line() {
        let w = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(shell_line(&w(&["bash"])), "exec bash");
        assert_eq!(shell_line(&w(&["ls", "-l", "/tmp"])), "exec ls -l /tmp");
        assert_eq!(shell_line(&w(&["echo", "a b", "it's", ""])), r"exec echo 'a b' 'it'\''s' ''");
    }

    #[test]
    fn the_url_carries_the_query_and_never_the_key() {
        let req = TtyRequest {
            id: "sb-0123456789abcdef",
            command: Some("exec top".into()),
            user: Some("root"),
            cwd: None,
            env: vec![("A".into(), "1 2".into())],
        };
        let u = url("http://127.0.0.1:8080/", &req, 120, 40).expect("url");
        assert_eq!(
            u,
            "ws://127.0.0.1:8080/v1/sandboxes/sb-0123456789abcdef/pty?cols=120&rows=40&command=exec+top&user=root&env=A%3D1+2"
        );
        assert!(url("https://h.example/", &req, 1, 1).expect("url").starts_with("wss://h.example/v1/sandboxes/"));
        assert!(url("ftp://h", &req, 1, 1).is_err());
    }
}

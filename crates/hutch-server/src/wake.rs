//! Idle CPUs kept polling while the API is busy (`hutch serve --wake-hold`).
//!
//! A command's answer crosses several processes: the daemon, the
//! sandbox's agent, the command, and back. Each is woken on a CPU that may
//! have gone idle, and where idle is a halt (a virtual machine's vCPU then
//! leaves for its hypervisor) every wakeup costs from tens of microseconds
//! to milliseconds. Linux's PM QoS interface (`/dev/cpu_dma_latency`) lets
//! a process ask that idle CPUs poll instead of halting, for as long as it
//! holds the file open with a latency of 0 written to it.
//!
//! The daemon holds that request from a request's arrival until `hold`
//! after the last answer, then closes it. Polling spends the idle CPUs'
//! time while it is held (power on a bare-metal host, the hypervisor's CPU
//! on a virtual one), which is why it is an opt-in. It changes no
//! isolation: only when idle CPUs wake.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

const QOS: &str = "/dev/cpu_dma_latency";

/// The daemon's PM QoS request, held while requests are in flight.
pub struct WakeHold {
    hold: Duration,
    state: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    /// Open while the request is in force; closing it ends it.
    qos: Option<File>,
    in_flight: usize,
    last: Option<Instant>,
    /// A task that ends the request once the API has been quiet for `hold`.
    closer: bool,
}

impl WakeHold {
    /// Fails when the host offers no PM QoS request this process may make
    /// (the file is root's).
    pub fn new(hold: Duration) -> std::io::Result<Arc<WakeHold>> {
        drop(open()?);
        Ok(Arc::new(WakeHold { hold, state: Mutex::new(Held::default()) }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the request is in force now.
    pub fn held(&self) -> bool {
        self.lock().qos.is_some()
    }

    fn enter(&self) {
        let mut s = self.lock();
        s.in_flight += 1;
        if s.qos.is_none() {
            match open() {
                Ok(f) => s.qos = Some(f),
                Err(e) => tracing::debug!("{QOS}: {e}"),
            }
        }
    }

    fn leave(self: &Arc<Self>) {
        let mut s = self.lock();
        s.in_flight -= 1;
        s.last = Some(Instant::now());
        if s.in_flight == 0 && s.qos.is_some() && !s.closer {
            s.closer = true;
            let me = self.clone();
            tokio::spawn(async move { me.close_when_quiet().await });
        }
    }

    /// Ends the request once no call has run for `hold`. A call running
    /// when it looks ends it instead: the answer that leaves none running
    /// starts the next one (no timer ticks through a long call).
    async fn close_when_quiet(self: Arc<Self>) {
        let mut wait = self.hold;
        loop {
            tokio::time::sleep(wait).await;
            let mut s = self.lock();
            if s.in_flight > 0 {
                s.closer = false;
                return;
            }
            let quiet = s.last.map_or(self.hold, |t| t.elapsed());
            if quiet >= self.hold {
                s.qos = None;
                s.closer = false;
                return;
            }
            wait = self.hold - quiet;
        }
    }
}

/// Opens the PM QoS request, asking idle CPUs to wake within 0 µs.
fn open() -> std::io::Result<File> {
    let mut f = std::fs::OpenOptions::new().write(true).open(QOS)?;
    f.write_all(&0i32.to_ne_bytes())?;
    Ok(f)
}

/// The layer: holds the request around every call.
pub async fn layer(State(wake): State<Arc<WakeHold>>, req: Request, next: Next) -> Response {
    struct Leave(Arc<WakeHold>);
    impl Drop for Leave {
        fn drop(&mut self) {
            self.0.leave();
        }
    }
    wake.enter();
    let _leave = Leave(wake.clone());
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's current idle-latency target: the lowest request held.
    fn target() -> i32 {
        let mut b = [0u8; 4];
        let mut f = File::open(QOS).expect("open the PM QoS file");
        std::io::Read::read_exact(&mut f, &mut b).expect("read the target");
        i32::from_ne_bytes(b)
    }

    #[tokio::test]
    async fn the_request_is_held_while_calls_run_and_ends_after_the_quiet_hold() {
        let w = WakeHold::new(Duration::from_millis(50)).expect("PM QoS (run as root)");
        assert!(!w.held());
        w.enter();
        assert!(w.held());
        assert_eq!(target(), 0, "a held request asks for 0 µs");
        w.enter();
        w.leave();
        // One call still runs: held whatever the time.
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert!(w.held());
        w.leave();
        assert!(w.held(), "held for the quiet time after the last answer");
        // A call that starts before the hold is over and outlasts it: the
        // waiting closer gives up, and the answer starts another.
        w.enter();
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert!(w.held());
        w.leave();
        let t0 = Instant::now();
        while w.held() {
            assert!(t0.elapsed() < Duration::from_secs(10), "never released");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(t0.elapsed() >= Duration::from_millis(40), "released before the hold: {:?}", t0.elapsed());
    }
}

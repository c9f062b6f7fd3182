//! The one batching loop of the writers that take records off the request
//! path (the audit log, events): a call queues a record and returns; the
//! writer appends what arrived within an interval in one store write (one
//! hold of the store's lock, which requests share, per interval rather
//! than per call).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// Takes what arrives on `rx` in batches of at most `max` and gives each
/// to `write`: a batch closes `every` after its first record came, or when
/// full. On `stop` the queue is closed (nothing is queued from then on)
/// and what it still holds is written; then it returns.
pub(crate) async fn write_batches<T, F, Fut>(
    mut rx: mpsc::Receiver<T>,
    max: usize,
    every: Duration,
    stop: Arc<Notify>,
    mut write: F,
) where
    F: FnMut(Vec<T>) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut batch = Vec::with_capacity(max);
    let mut stopping = false;
    loop {
        let n = if stopping {
            rx.recv_many(&mut batch, max).await
        } else {
            tokio::select! {
                n = rx.recv_many(&mut batch, max) => n,
                () = stop.notified() => {
                    rx.close();
                    stopping = true;
                    continue;
                }
            }
        };
        // Closed and drained.
        if n == 0 {
            return;
        }
        let deadline = tokio::time::Instant::now() + every;
        while !stopping && batch.len() < max {
            let room = max - batch.len();
            tokio::select! {
                n = rx.recv_many(&mut batch, room) => if n == 0 { break },
                () = tokio::time::sleep_until(deadline) => break,
                () = stop.notified() => {
                    rx.close();
                    stopping = true;
                }
            }
        }
        write(std::mem::replace(&mut batch, Vec::with_capacity(max))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_come_in_batches_and_a_stop_writes_what_is_queued() {
        let (tx, rx) = mpsc::channel(64);
        let stop = Arc::new(Notify::new());
        let seen = Arc::new(std::sync::Mutex::new(Vec::<Vec<u32>>::new()));
        let s = seen.clone();
        for i in 0..10 {
            tx.send(i).await.expect("send");
        }
        let writer = tokio::spawn(write_batches(rx, 4, Duration::from_secs(3600), stop.clone(), move |b| {
            s.lock().expect("lock").push(b);
            async {}
        }));
        // Full batches go at once; the rest waits for the interval or a stop.
        stop.notify_one();
        writer.await.expect("writer");
        drop(tx);
        let got = seen.lock().expect("lock").clone();
        assert_eq!(got.concat(), (0..10).collect::<Vec<_>>());
        assert!(got.iter().all(|b| b.len() <= 4), "{got:?}");
    }
}

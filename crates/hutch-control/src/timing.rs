//! Where a request's time went on the server, for the API's
//! `Server-Timing` header: the HTTP layer opens a [`Phases`] around a
//! handler ([`Phases::scope`]); the control plane [`record`]s the phases it
//! names (a no-op outside a scope). Names only and durations: nothing of a
//! request's content goes in.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

tokio::task_local! {
    static PHASES: Phases;
}

/// The phases one request recorded, in order.
#[derive(Clone, Default)]
pub struct Phases(Arc<Mutex<Vec<(&'static str, Duration)>>>);

impl Phases {
    /// Runs `f` with these phases as the ones [`record`] adds to.
    pub async fn scope<F: Future>(self, f: F) -> F::Output {
        PHASES.scope(self, f).await
    }

    /// The phases of the running request's scope, to carry into a task it
    /// spawns (a task does not inherit its spawner's scope).
    pub fn current() -> Option<Phases> {
        PHASES.try_with(Phases::clone).ok()
    }

    /// What was recorded, in order.
    pub fn taken(&self) -> Vec<(&'static str, Duration)> {
        self.0.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

/// Adds phase `name` of `took` to the running request's phases.
pub fn record(name: &'static str, took: Duration) {
    let _ = PHASES.try_with(|p| {
        if let Ok(mut p) = p.0.lock() {
            p.push((name, took));
        }
    });
}

/// Records phase `name` as the time since `since`, and returns now.
pub fn mark(name: &'static str, since: Instant) -> Instant {
    let now = Instant::now();
    record(name, now - since);
    now
}

/// Runs `f` in `phases`' scope, or as it is without one.
pub async fn within<F: Future>(phases: Option<Phases>, f: F) -> F::Output {
    match phases {
        Some(p) => p.scope(f).await,
        None => f.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_in_scope_and_in_a_task_it_carries_into() {
        let phases = Phases::default();
        phases
            .clone()
            .scope(async {
                record("a", Duration::from_millis(1));
                let carried = Phases::current();
                tokio::spawn(within(carried, async { record("b", Duration::from_millis(2)) })).await.expect("task");
                // Not carried: lost, not a panic.
                tokio::spawn(async { record("c", Duration::from_millis(3)) }).await.expect("task");
            })
            .await;
        let names: Vec<_> = phases.taken().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "b"]);
        // Outside any scope, nothing is recorded and nothing fails.
        record("d", Duration::ZERO);
        assert_eq!(phases.taken().len(), 2);
    }
}

//! The `process` class on the control plane: the host containers its
//! sandboxes are tenants of, one per (owner, template, root), made on first
//! use and kept warm for the daemon's life, so that a create does no
//! namespace, mount or network work (see hutch-runtime's `process.rs`).
//!
//! Host containers are no sandboxes of the API: no record, never listed;
//! their cgroups are named `ph-...`. One owner's sandboxes never share a
//! host container with another owner's.

use std::collections::HashMap;
use std::sync::Arc;

use hutch_runtime::{Sandbox, SandboxSpec};

use crate::error::{ControlError, Result};

/// The prefix of host containers' ids.
pub const HOST_PREFIX: &str = "ph-";

/// Memory and pids of a host container (its agent and its tenants' file
/// operations; each tenant has its own cgroup beside it).
const HOST_MEMORY: u64 = 2 << 30;
const HOST_PIDS: u32 = 4096;

/// The live host containers of this daemon, each with how many tenants
/// it holds: a host container ends with its last tenant (so a template's
/// deletion, or the end of its sandboxes, leaves nothing running), and is
/// made again by the next create.
#[derive(Default)]
pub(crate) struct Hosts {
    map: tokio::sync::Mutex<HostMap>,
}

#[derive(Default)]
struct HostMap {
    by_key: HashMap<String, (Arc<Sandbox>, usize)>,
    /// Tenant (sandbox id) to the key of its host.
    tenants: HashMap<String, String>,
}

impl Hosts {
    /// The host container for `key`, counting `tenant` in it, started with
    /// `start` when there is none yet (creates of any key wait for that
    /// start: it happens once per key). Call [`Hosts::release`] when the
    /// tenant ends or failed to start.
    pub(crate) async fn acquire<F>(&self, key: String, tenant: &str, start: F) -> Result<Arc<Sandbox>>
    where
        F: FnOnce() -> std::result::Result<Sandbox, ControlError> + Send + 'static,
    {
        let mut map = self.map.lock().await;
        let alive = |h: &Sandbox| std::path::Path::new(&format!("/proc/{}", h.pid)).exists();
        if map.by_key.get(&key).is_some_and(|(h, _)| !alive(h)) {
            if let Some((dead, _)) = map.by_key.remove(&key) {
                end(dead).await;
            }
        }
        if !map.by_key.contains_key(&key) {
            let host = Arc::new(tokio::task::spawn_blocking(start).await??);
            map.by_key.insert(key.clone(), (host, 0));
        }
        let entry = map.by_key.get_mut(&key).expect("present");
        entry.1 += 1;
        let host = entry.0.clone();
        map.tenants.insert(tenant.to_owned(), key);
        Ok(host)
    }

    /// Counts `tenant` out of its host container; ends the host container
    /// when it was the last.
    pub(crate) async fn release(&self, tenant: &str, network: Option<&Arc<hutch_runtime::net::Network>>) {
        let mut map = self.map.lock().await;
        let Some(key) = map.tenants.remove(tenant) else { return };
        let last = match map.by_key.get_mut(&key) {
            Some(entry) => {
                entry.1 = entry.1.saturating_sub(1);
                entry.1 == 0
            }
            None => false,
        };
        if last {
            if let Some((host, _)) = map.by_key.remove(&key) {
                let id = host.id.clone();
                end(host).await;
                if let Some(net) = network {
                    net.release(&id);
                }
            }
        }
    }
}

/// Ends a host container (what is left of its tenants with it).
async fn end(host: Arc<Sandbox>) {
    let id = host.id.clone();
    let ended = match Arc::try_unwrap(host) {
        Ok(sb) => tokio::task::spawn_blocking(move || sb.destroy()).await.map_err(|e| e.to_string()),
        // Still held by a create that failed: its processes end now, its
        // directories with the next sweep.
        Err(sb) => Ok(sb.cgroup.kill_all().map_err(hutch_runtime::RuntimeError::from)),
    };
    match ended {
        Ok(Ok(())) => tracing::debug!("host container {id} ended"),
        Ok(Err(e)) => tracing::warn!("host container {id}: {e}"),
        Err(e) => tracing::warn!("host container {id}: {e}"),
    }
}

/// The host container's spec from a process sandbox's: the same root and
/// environment of the image, limits for its agent.
pub(crate) fn host_spec(spec: &SandboxSpec, id: String) -> SandboxSpec {
    SandboxSpec {
        id: Some(id),
        class: hutch_runtime::Class::Container,
        limits: hutch_runtime::cgroup::Limits { memory_bytes: HOST_MEMORY, pids: HOST_PIDS, ..spec.limits },
        // Every tenant's home is on its memory layer.
        disk_bytes: spec.disk_bytes.max(1 << 30),
        volumes: Vec::new(),
        ..spec.clone()
    }
}

/// A fresh host container id.
pub(crate) fn host_id() -> Result<String> {
    let id = hutch_runtime::container::random_id().map_err(|e| ControlError::Runtime(e.to_string()))?;
    Ok(format!("{HOST_PREFIX}{}", &id[..id.len().min(16)]))
}

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

/// The live host containers of this daemon.
#[derive(Default)]
pub(crate) struct Hosts {
    map: tokio::sync::Mutex<HashMap<String, Arc<Sandbox>>>,
}

impl Hosts {
    /// The host container for `key`, started with `start` when there is
    /// none yet (creates of one key wait for that start; others do not
    /// hold it long).
    pub(crate) async fn get_or_start<F>(&self, key: String, start: F) -> Result<Arc<Sandbox>>
    where
        F: FnOnce() -> std::result::Result<Sandbox, ControlError> + Send + 'static,
    {
        let mut map = self.map.lock().await;
        if let Some(h) = map.get(&key) {
            if std::path::Path::new(&format!("/proc/{}", h.pid)).exists() {
                return Ok(h.clone());
            }
            map.remove(&key);
        }
        let host = Arc::new(tokio::task::spawn_blocking(start).await??);
        map.insert(key, host.clone());
        Ok(host)
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

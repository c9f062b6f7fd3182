//! `GET /v1/capabilities`: what this host runs and allows, read from the
//! same values the control plane checks requests against (the bounds of
//! `resolve_limits`, the host's capacity, the builtin template's lifetime,
//! the network and the storage it set up), never from a copy of them.

use crate::control::{Control, BASE, DISK_MIB, MEMORY_MB, PIDS, VCPUS};
use crate::error::Result;
use crate::ids::Caller;
use hutch_api::{Capabilities, Feature, IsolationClass, LimitRanges, Range};
use std::collections::BTreeMap;

fn on() -> Feature {
    Feature { enabled: true, reason: None }
}

fn off(reason: impl Into<String>) -> Feature {
    Feature { enabled: false, reason: Some(reason.into()) }
}

impl Control {
    /// What a create may ask for on this host: the request bounds, and for
    /// memory and disk no more than one sandbox may hold here.
    pub fn limit_ranges(&self) -> LimitRanges {
        let memory_max = MEMORY_MB.1.min(self.capacity.sandbox_memory_mb);
        let disk_max = DISK_MIB.1.min(self.capacity.sandbox_disk_mib);
        LimitRanges {
            memory_mb: Range { min: MEMORY_MB.0 as f64, max: memory_max as f64 },
            vcpus: Range { min: VCPUS.0, max: VCPUS.1 },
            disk_mib: Range { min: DISK_MIB.0 as f64, max: disk_max as f64 },
            pids: Range { min: f64::from(PIDS.0), max: f64::from(PIDS.1) },
            ttl_seconds: Range { min: 1.0, max: BASE.max_ttl.as_secs() as f64 },
            template_max_ttl_seconds: crate::templates::MAX_TTL_CAP,
        }
    }

    /// The host's capabilities, with the caller's quotas and usage.
    pub async fn capabilities(&self, caller: &Caller) -> Result<Capabilities> {
        let usage = self.usage(caller, None).await?;
        let disk = self.runtime.storage().is_some();
        let no_disk = "disk storage is not available on this host (see `hutch doctor` and the daemon's log)";
        let mut features = BTreeMap::new();
        features.insert(
            "networks".to_owned(),
            match &self.network {
                Ok(_) => on(),
                Err(why) => off(format!("only deny_all sandboxes start: {why}")),
            },
        );
        features.insert("disk_storage".to_owned(), if disk { on() } else { off(no_disk) });
        for name in ["snapshots", "fork"] {
            features.insert(name.to_owned(), if disk { on() } else { off(format!("needs disk storage: {no_disk}")) });
        }
        features.insert(
            "memory_snapshots".to_owned(),
            match (disk, self.runtime.runs(hutch_api::Class::Gvisor)) {
                (true, Ok(())) => on(),
                (false, _) => off(format!("memory snapshots keep a disk layer too: {no_disk}")),
                (true, Err(why)) => off(format!("memory snapshots are of gvisor sandboxes: {why}")),
            },
        );
        features.insert(
            "secrets".to_owned(),
            match (&self.network, &self.egress_bundle) {
                (Ok(_), Some(_)) => on(),
                (Err(why), _) => off(format!("secrets are injected by the egress proxy, which needs networks: {why}")),
                (Ok(_), None) => off("the egress proxy is not running".to_owned()),
            },
        );
        features.insert("fleet".to_owned(), off("this daemon runs sandboxes on its own host only"));
        for name in ["console", "mcp", "audit"] {
            features.insert(name.to_owned(), on());
        }
        Ok(Capabilities {
            api_version: hutch_api::API_VERSION.to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            classes: hutch_api::Class::ALL
                .into_iter()
                .map(|class| {
                    let runs = self.runtime.runs(class);
                    IsolationClass { name: class.as_str().into(), available: runs.is_ok(), reason: runs.err() }
                })
                .collect(),
            default_class: self.default_class.as_str().into(),
            limits: self.limit_ranges(),
            usage,
            features,
        })
    }
}

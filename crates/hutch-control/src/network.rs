//! Sandbox networks in the control plane: a policy is checked at create,
//! stored with the sandbox, attached before the sandbox starts (so its
//! first packet is judged), observed on the host after it starts
//! (`network.applied`), and released when it ends.
//!
//! A policy that cannot be enforced fails closed: the sandbox does not
//! start.

use crate::error::{ControlError, Result};
use hutch_api::{Egress, Network as NetworkView, NetworkRequest};
use hutch_runtime::net::{self, Attached, Policy, Rule};
use serde::{Deserialize, Serialize};

/// At most this many entries in each of `allow` and `deny`.
pub const MAX_RULES: usize = 64;

/// A sandbox's network as stored (JSON in the `network` column).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NetRecord {
    #[serde(default)]
    pub egress: Egress,
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
    /// What was observed: `default`, `deny_all`, `private` or `unknown`.
    #[serde(default = "unknown")]
    pub applied: String,
    /// Host side, once attached: address index and host link.
    #[serde(default)]
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_if: Option<String>,
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Keep a network interface even under `deny_all`, so that the policy
    /// can open while the sandbox runs (an E2B sandbox made without
    /// internet: `PUT /sandboxes/{id}/network`). Its address is then in no
    /// set of the host's rules.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interface: bool,
    /// What the E2B API keeps of a sandbox it made: its rules as the client
    /// gave them, and the settings of its ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2b: Option<E2bNetwork>,
    /// The owner's secrets it names: its HTTPS flows go through the
    /// host's egress proxy, which injects them for their hosts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// E2B's network settings of a sandbox: egress rules as given (shown back
/// by the E2B API; [`crate::e2b::egress_policy`] turns them into a hutch
/// policy) and who reaches its ports through E2B's host names.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct E2bNetwork {
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
    #[serde(default)]
    pub allow_internet_access: Option<bool>,
    /// Its ports answer anyone who names them; otherwise only requests
    /// with the sandbox's traffic access token.
    #[serde(default = "yes")]
    pub public: bool,
    /// The Host the port sees (`${PORT}` is replaced by the port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// A request to its port resumes it when it is paused.
    #[serde(default)]
    pub auto_resume: bool,
}

impl Default for E2bNetwork {
    fn default() -> E2bNetwork {
        E2bNetwork {
            allow_out: Vec::new(),
            deny_out: Vec::new(),
            allow_internet_access: None,
            public: true,
            mask_request_host: None,
            auto_resume: false,
        }
    }
}

fn yes() -> bool {
    true
}

fn unknown() -> String {
    "unknown".into()
}

impl NetRecord {
    /// Checks a request; the result is what gets stored.
    pub fn from_request(req: Option<&NetworkRequest>) -> Result<NetRecord> {
        let req = req.cloned().unwrap_or_default();
        if req.egress != Egress::Default && !(req.allow.is_empty() && req.deny.is_empty()) {
            return Err(ControlError::Invalid("network.allow and network.deny apply to `default` egress only".into()));
        }
        for (what, list) in [("allow", &req.allow), ("deny", &req.deny)] {
            if list.len() > MAX_RULES {
                return Err(ControlError::Invalid(format!("network.{what}: at most {MAX_RULES} entries")));
            }
            for entry in list {
                Rule::parse(entry).map_err(|e| ControlError::Invalid(format!("network.{what}: {e}")))?;
            }
        }
        Ok(NetRecord {
            egress: req.egress,
            allow: req.allow,
            deny: req.deny,
            applied: unknown(),
            ..NetRecord::default()
        })
    }

    pub fn parse(json: &str) -> NetRecord {
        serde_json::from_str(json).unwrap_or_else(|_| NetRecord { applied: unknown(), ..NetRecord::default() })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }

    /// The runtime's policy; `group` is who `private` sandboxes may reach.
    pub fn policy(&self, owner: &str, template: &str) -> Policy {
        let rules = |l: &[String]| l.iter().filter_map(|s| Rule::parse(s).ok()).collect();
        Policy {
            egress: match self.egress {
                Egress::Default => net::Egress::Default,
                Egress::DenyAll => net::Egress::DenyAll,
                Egress::Private => net::Egress::Private,
            },
            allow: rules(&self.allow),
            deny: rules(&self.deny),
            group: format!("{owner}/{template}"),
            inject: !self.secrets.is_empty(),
        }
    }

    pub fn attached(&mut self, a: &Attached) {
        self.index = a.index;
        self.host_if = a.host_if.clone();
        self.addresses = a.addr4.map(|x| x.to_string()).into_iter().chain(a.addr6.map(|x| x.to_string())).collect();
    }

    pub fn view(&self) -> NetworkView {
        NetworkView {
            egress: self.egress,
            allow: self.allow.clone(),
            deny: self.deny.clone(),
            applied: self.applied.clone(),
            addresses: self.addresses.clone(),
        }
    }
}

impl crate::control::Control {
    /// Replaces the egress policy of a running sandbox of the caller while
    /// it runs: the host's set elements are swapped (see
    /// `Network::update`), addresses its resolver admitted for the old
    /// policy are forgotten, and the record follows. `e2b` replaces the
    /// E2B settings kept with it. A sandbox started without an interface
    /// (`deny_all`) can only stay closed: `conflict`. Port grants end when
    /// the policy closes (nothing reaches a native `deny_all` sandbox, the
    /// proxy included); an E2B sandbox keeps serving its ports.
    pub async fn update_network(
        &self,
        caller: &crate::ids::Caller,
        id: &crate::ids::SandboxId,
        req: &NetworkRequest,
        e2b: Option<E2bNetwork>,
    ) -> Result<hutch_api::Sandbox> {
        let r = self.record_here(caller, id, crate::control::Need::Use).await?;
        if r.state != hutch_api::SandboxState::Running {
            return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
        }
        let asked = self.network_record(Some(req))?;
        let net = match &self.network {
            Ok(n) => n.clone(),
            // Without networking every sandbox is closed, and stays so.
            Err(_) => return Err(ControlError::Conflict(format!("sandbox {id} has no network interface"))),
        };
        let (store, lock) = (self.store.clone(), self.net_updates.clone());
        let (this_id, owner) = (id.to_string(), r.owner.clone());
        let template = r.template_id.clone().unwrap_or_else(|| r.template.clone());
        let pid = r.host_pid;
        let updated = tokio::task::spawn_blocking(move || -> Result<NetRecord> {
            let _one_at_a_time = lock.lock().unwrap_or_else(|p| p.into_inner());
            let mut rec = match store.get_sandbox(&this_id)? {
                Some(r) if r.state == hutch_api::SandboxState::Running => NetRecord::parse(&r.network),
                Some(r) => return Err(ControlError::NotRunning { id: this_id, state: r.state }),
                None => return Err(ControlError::NoSandbox(this_id)),
            };
            rec.egress = asked.egress;
            rec.allow = asked.allow;
            rec.deny = asked.deny;
            if e2b.is_some() {
                rec.e2b = e2b;
            }
            net.update(&this_id, &rec.policy(&owner, &template)).map_err(|e| match e {
                hutch_runtime::net::NetError::NoInterface(_) => ControlError::Conflict(format!(
                    "sandbox {this_id} was started without a network interface (deny_all); its network stays closed"
                )),
                e => ControlError::Runtime(e.to_string()),
            })?;
            rec.applied = match pid {
                Some(pid) => applied(net.observe(&this_id, pid as libc::pid_t)),
                None => unknown(),
            };
            store.set_network(&this_id, &rec.to_json())?;
            store.set_net_learned(&this_id, "[]")?;
            Ok(rec)
        })
        .await??;
        // E2B's egress rules say nothing of what comes in: its sandboxes
        // keep serving their ports (see `check_port_access`).
        if updated.egress == Egress::DenyAll && updated.e2b.is_none() {
            self.access.revoke_sandbox(id.as_str());
        }
        self.log(
            id,
            crate::history::LogLevel::Info,
            format!("network policy changed to {}", describe(&updated)),
            &[("egress", egress_name(updated.egress).to_owned())],
        );
        let r = self.record_here(caller, id, crate::control::Need::Use).await?;
        Ok(crate::control::view(&r))
    }
}

fn egress_name(e: Egress) -> &'static str {
    match e {
        Egress::Default => "default",
        Egress::DenyAll => "deny_all",
        Egress::Private => "private",
    }
}

/// A policy in a few words, for the sandbox's log.
fn describe(n: &NetRecord) -> String {
    match (n.egress, n.allow.is_empty(), n.deny.is_empty()) {
        (Egress::DenyAll, _, _) => "deny_all".into(),
        (Egress::Private, _, _) => "private".into(),
        (Egress::Default, false, _) => format!("only {}", n.allow.join(", ")),
        (Egress::Default, true, false) => format!("all but {}", n.deny.join(", ")),
        (Egress::Default, true, true) => "default".into(),
    }
}

/// What `observe` saw, as the API spells it.
pub fn applied(seen: Option<net::Egress>) -> String {
    seen.map(|e| e.as_str().to_owned()).unwrap_or_else(unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_only_with_default_egress_and_bounded() {
        let req = |egress, allow: Vec<&str>| NetworkRequest {
            egress,
            allow: allow.into_iter().map(String::from).collect(),
            deny: vec![],
        };
        assert!(NetRecord::from_request(Some(&req(Egress::DenyAll, vec!["pypi.org"]))).is_err());
        assert!(NetRecord::from_request(Some(&req(Egress::Default, vec!["not a name"]))).is_err());
        let many: Vec<String> = (0..=MAX_RULES).map(|i| format!("10.0.{i}.0/24")).collect();
        let r = NetworkRequest { egress: Egress::Default, allow: many, deny: vec![] };
        assert!(NetRecord::from_request(Some(&r)).is_err());
        let ok =
            NetRecord::from_request(Some(&req(Egress::Default, vec!["*.github.com", "10.1.0.0/16"]))).expect("valid");
        assert_eq!(ok.applied, "unknown");
        assert_eq!(NetRecord::from_request(None).expect("default").egress, Egress::Default);
    }

    #[test]
    fn stored_form_round_trips_and_tolerates_old_rows() {
        let r = NetRecord { egress: Egress::Private, applied: "private".into(), index: 7, ..NetRecord::default() };
        assert_eq!(NetRecord::parse(&r.to_json()), r);
        assert_eq!(NetRecord::parse("{}").applied, "unknown");
    }
}

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

//! The names of things a caller may name: sandboxes, owners (API keys),
//! templates and builds. Each is a newtype that only a parse of its one
//! form makes, so a malformed path segment names nothing and can reach
//! neither the store nor the host's file system.

use crate::error::{ControlError, Result};
use std::fmt;

/// `n` random bytes as lowercase hex.
pub(crate) fn random_hex(n: usize) -> Result<String> {
    let mut b = vec![0u8; n];
    hutch_runtime::sys::random_bytes(&mut b).map_err(|e| ControlError::Runtime(format!("random bytes: {e}")))?;
    Ok(hex::encode(b))
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

id_type!(
    /// A sandbox: `sb-` and 16 hex digits (build sandboxes, which callers
    /// never name, are `bs-...`).
    SandboxId
);

impl SandboxId {
    /// A path segment that may name a sandbox; anything else names none
    /// (`not_found`).
    pub fn parse(s: &str) -> Result<SandboxId> {
        match s.strip_prefix("sb-") {
            Some(hex) if is_hex(hex, 16) => Ok(SandboxId(s.to_owned())),
            _ => Err(ControlError::NoSandbox(truncated(s))),
        }
    }

    pub(crate) fn random() -> Result<SandboxId> {
        Ok(SandboxId(format!("sb-{}", random_hex(8)?)))
    }

    /// An id read back from the store or the host, trusted as written.
    pub(crate) fn from_record(s: &str) -> SandboxId {
        SandboxId(s.to_owned())
    }
}

id_type!(
    /// A snapshot: `snap-` and 16 hex digits.
    SnapshotId
);

impl SnapshotId {
    /// A path segment that may name a snapshot; anything else names none
    /// (`not_found`).
    pub fn parse(s: &str) -> Result<SnapshotId> {
        match s.strip_prefix("snap-") {
            Some(hex) if is_hex(hex, 16) => Ok(SnapshotId(s.to_owned())),
            _ => Err(ControlError::NoSnapshot(truncated(s))),
        }
    }

    pub(crate) fn random() -> Result<SnapshotId> {
        Ok(SnapshotId(format!("snap-{}", random_hex(8)?)))
    }
}

id_type!(
    /// A volume: `vol-` and 16 hex digits.
    VolumeId
);

impl VolumeId {
    /// A string that may be a volume's id (else, a name).
    pub fn parse(s: &str) -> Result<VolumeId> {
        match s.strip_prefix("vol-") {
            Some(hex) if is_hex(hex, 16) => Ok(VolumeId(s.to_owned())),
            _ => Err(ControlError::NoVolume(truncated(s))),
        }
    }

    pub(crate) fn random() -> Result<VolumeId> {
        Ok(VolumeId(format!("vol-{}", random_hex(8)?)))
    }
}

id_type!(
    /// An owner: the id of the API key that made a thing (`key-` and 12
    /// hex digits).
    OwnerId
);

impl OwnerId {
    pub fn parse(s: &str) -> Result<OwnerId> {
        match s.strip_prefix("key-") {
            Some(hex) if is_hex(hex, 12) => Ok(OwnerId(s.to_owned())),
            _ => Err(ControlError::NoKey(truncated(s))),
        }
    }

    pub(crate) fn random() -> Result<OwnerId> {
        Ok(OwnerId(format!("key-{}", random_hex(6)?)))
    }

    pub(crate) fn from_record(s: &str) -> OwnerId {
        OwnerId(s.to_owned())
    }
}

id_type!(
    /// A template: `tpl-` and 16 hex digits.
    TemplateId
);

impl TemplateId {
    pub fn parse(s: &str) -> Result<TemplateId> {
        match s.strip_prefix("tpl-") {
            Some(hex) if is_hex(hex, 16) => Ok(TemplateId(s.to_owned())),
            _ => Err(ControlError::NoTemplate(truncated(s))),
        }
    }

    pub(crate) fn random() -> Result<TemplateId> {
        Ok(TemplateId(format!("tpl-{}", random_hex(8)?)))
    }
}

/// Who is calling: the owner their key makes them, whether it is an admin
/// key (which sees and ends every owner's things), and, when the
/// credential is a grant, what the grant restricts it to
/// ([`Caller::admit`](crate::grants)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub owner: OwnerId,
    pub admin: bool,
    pub grant: Option<std::sync::Arc<crate::grants::GrantScope>>,
    /// The key's quotas as this request's authentication read them; None
    /// where it read none (a grant, the daemon acting for an owner), and
    /// [`Control::quotas_of`](crate::Control) reads them then.
    pub quotas: Option<hutch_store::Quotas>,
}

/// Which owners a listing covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owners {
    One(OwnerId),
    /// Every owner's (admin only).
    All,
}

impl Caller {
    /// The caller an API key makes.
    pub fn key(owner: OwnerId, admin: bool) -> Caller {
        Caller { owner, admin, grant: None, quotas: None }
    }

    /// The owners a listing of this caller covers: its own, or with
    /// `?owner=` (admin keys only) another's or everyone's (`*`). A grant
    /// lists nothing.
    pub fn listing(&self, owner: Option<&str>) -> Result<Owners> {
        self.no_grant("list")?;
        match owner {
            None => Ok(Owners::One(self.owner.clone())),
            Some(_) if !self.admin => Err(ControlError::Forbidden("only an admin key may list another owner's".into())),
            Some("*") => Ok(Owners::All),
            Some(o) => Ok(Owners::One(OwnerId::parse(o)?)),
        }
    }

    /// Whether this caller may see or end a thing of `owner`.
    pub fn may_manage(&self, owner: &str) -> bool {
        self.admin || self.owner.as_str() == owner
    }

    /// Whether this caller may use (run commands in, move files in and out
    /// of, open ports of) a thing of `owner`: its owner only.
    pub fn may_use(&self, owner: &str) -> bool {
        self.owner.as_str() == owner
    }
}

impl Owners {
    pub(crate) fn filter(&self) -> Option<&str> {
        match self {
            Owners::One(o) => Some(o.as_str()),
            Owners::All => None,
        }
    }
}

/// An id in an error message, cut so a hostile path cannot fill a log.
pub(crate) fn truncated(s: &str) -> String {
    let cut: String = s.chars().take(64).collect();
    if cut.len() < s.len() {
        format!("{cut}...")
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_one_form() {
        let sb = SandboxId::random().expect("random");
        assert_eq!(SandboxId::parse(sb.as_str()).expect("parse"), sb);
        let t = TemplateId::random().expect("random");
        assert_eq!(TemplateId::parse(t.as_str()).expect("parse"), t);
        let o = OwnerId::random().expect("random");
        assert_eq!(OwnerId::parse(o.as_str()).expect("parse"), o);
        for bad in ["", "sb-", "sb-0123", "sb-0123456789ABCDEF", "bs-0123456789abcdef", "sb-../../etc/passwd00"] {
            assert!(SandboxId::parse(bad).is_err(), "{bad}");
        }
        for bad in ["", "tpl-", "tpl-../../etc/passwd", "sb-0123456789abcdef", "tpl-0123456789ABCDEF"] {
            assert!(TemplateId::parse(bad).is_err(), "{bad}");
        }
        assert!(OwnerId::parse("key-0123456789ab").is_ok());
        assert!(OwnerId::parse("key-0123456789a").is_err());
        assert_eq!(truncated(&"x".repeat(100)).len(), 67);
    }

    #[test]
    fn only_admins_list_or_end_another_owners_things() {
        let me = Caller::key(OwnerId::from_record("key-000000000001"), false);
        assert_eq!(me.listing(None).expect("own"), Owners::One(me.owner.clone()));
        assert!(me.listing(Some("*")).is_err());
        assert!(!me.may_manage("key-000000000002") && me.may_manage("key-000000000001"));
        let admin = Caller::key(OwnerId::from_record("key-00000000000a"), true);
        assert_eq!(admin.listing(Some("*")).expect("all"), Owners::All);
        assert!(admin.listing(Some("nope")).is_err());
        assert!(admin.may_manage("key-000000000001") && !admin.may_use("key-000000000001"));
    }
}

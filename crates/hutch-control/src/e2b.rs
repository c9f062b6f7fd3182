//! Credentials of the E2B API's in-sandbox (envd) calls, checked here so
//! that every entry point meets the same owner check: a sandbox's access
//! token, and signed `/files` URLs.
//!
//! Access tokens are stateless: HMAC-SHA256 of the sandbox id under a
//! daemon secret kept in the state directory (`e2b.secret`), so they
//! survive restarts like the sandboxes do, and are revoked for every
//! sandbox at once by replacing the secret. A token alone is not enough:
//! the sandbox must run (or start) and its owner's key must be live, on
//! every call, so revoking a key cuts its sandboxes' tokens off at once.
//!
//! A signed URL (the SDK's `download_url`/`upload_url`) is
//! `v1_` + base64 (unpadded) of SHA-256 over
//! `path:operation:username:token[:expiration]`: it binds the path, the
//! operation and the sandbox user, so the call runs as that user and as
//! no other.

use crate::control::{now_ms, Control};
use crate::error::{ControlError, Result};
use crate::ids::{OwnerId, SandboxId};
use crate::session::EnvdSession;
use base64::Engine;
use hmac::{Hmac, Mac};
use hutch_api::SandboxState;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What a `/files` URL was signed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// The signature parameters of a `/files` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedUrl {
    pub path: String,
    pub operation: Operation,
    /// The `username` parameter, as signed (empty: the default user).
    pub username: String,
    pub signature: String,
    /// Unix seconds.
    pub expiration: Option<i64>,
}

/// The envd access token of a sandbox under `secret`.
pub fn access_token(secret: &[u8], sandbox: &str) -> String {
    // HMAC takes keys of any length; the error arm cannot happen.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return String::new() };
    mac.update(sandbox.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// Compares in constant time (lengths are not secret).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

impl SignedUrl {
    /// The signature a URL for this path, operation and user gets under the
    /// sandbox's `token`.
    fn expected(&self, token: &str) -> String {
        let raw = match self.expiration {
            None => format!("{}:{}:{}:{token}", self.path, self.operation.as_str(), self.username),
            Some(e) => format!("{}:{}:{}:{token}:{e}", self.path, self.operation.as_str(), self.username),
        };
        format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes())))
    }

    /// The sandbox user the URL was signed for.
    pub fn user(&self) -> &str {
        if self.username.is_empty() {
            "user"
        } else {
            &self.username
        }
    }
}

impl Control {
    /// The envd access token of a sandbox.
    pub fn e2b_token(&self, id: &SandboxId) -> String {
        access_token(&self.e2b_secret, id.as_str())
    }

    /// A session for a sandbox's live owner, if the sandbox runs (or starts).
    async fn envd_session(&self, id: &SandboxId, user: &str) -> Result<EnvdSession> {
        let gone = || ControlError::NoSandbox(id.to_string());
        let r = self.sandbox_record(id).await?.ok_or_else(gone)?;
        if r.pooled || !matches!(r.state, SandboxState::Running | SandboxState::Starting) {
            // Terminated, terminating or paused: envd is not reachable.
            return Err(gone());
        }
        let owner = OwnerId::from_record(&r.owner);
        self.quotas_of(&owner)
            .await
            .map_err(|_| ControlError::Unauthorized("the API key that owns this sandbox was revoked"))?;
        EnvdSession::new(id.clone(), owner, user)
    }

    /// An envd call with `X-Access-Token`, as `user`.
    pub async fn envd_by_token(&self, id: &SandboxId, token: &str, user: &str) -> Result<EnvdSession> {
        if !same(token, &self.e2b_token(id)) {
            return Err(ControlError::Unauthorized("a valid X-Access-Token is required"));
        }
        self.envd_session(id, user).await
    }

    /// A call without a credential to a sandbox's port: granted only for
    /// the code interpreter's server port of a sandbox of the interpreter's
    /// template (the caller checked that the call is one of its context
    /// routes), because E2B's SDK sends those with none. Executing code
    /// takes the access token.
    pub async fn envd_interpreter_open(&self, id: &SandboxId, port: u16) -> Result<EnvdSession> {
        let refused = ControlError::Unauthorized("a valid X-Access-Token is required");
        if port != hutch_runtime::image::interp::PORT {
            return Err(refused);
        }
        // A sandbox that does not exist is refused like one of another
        // template: the answer says nothing about other sandboxes.
        match self.sandbox_record(id).await? {
            Some(r) if r.template == crate::templates::INTERPRETER => self.envd_session(id, "user").await,
            _ => Err(refused),
        }
    }

    /// A `/files` call authorized by a signed URL. `named` is the sandbox
    /// the request names (its header or host); without one, the running
    /// sandboxes are tried in turn (one hash each). `basic_user` is a user
    /// named by `Authorization: Basic`, which must be the signed one.
    pub async fn envd_by_signature(
        &self,
        named: Option<&SandboxId>,
        signed: &SignedUrl,
        basic_user: Option<&str>,
    ) -> Result<EnvdSession> {
        let invalid = ControlError::Unauthorized("invalid signature");
        let id = match named {
            Some(id) => Some(id.clone()).filter(|id| same(&signed.signature, &signed.expected(&self.e2b_token(id)))),
            None => self
                .lives()
                .into_iter()
                .map(|l| l.id.clone())
                .find(|id| same(&signed.signature, &signed.expected(&self.e2b_token(id)))),
        };
        let id = id.ok_or(invalid)?;
        if signed.expiration.is_some_and(|e| e < now_ms() / 1000) {
            return Err(ControlError::Unauthorized("signature is already expired"));
        }
        if basic_user.is_some_and(|u| !u.is_empty() && u != signed.user()) {
            return Err(ControlError::Unauthorized("the URL was signed for another user"));
        }
        self.envd_session(&id, signed.user()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_hmac_sha256_of_the_sandbox_id() {
        // RFC 4231, test case 2.
        assert_eq!(
            access_token(b"Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_ne!(access_token(b"s", "a"), access_token(b"s", "b"));
        assert_ne!(access_token(b"s", "a"), access_token(b"t", "a"));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("ab", "abc"));
    }

    #[test]
    fn a_signature_binds_path_operation_and_user() {
        let url = |path: &str, op, user: &str| SignedUrl {
            path: path.into(),
            operation: op,
            username: user.into(),
            signature: String::new(),
            expiration: Some(1),
        };
        let sig = url("/a", Operation::Read, "user").expected("tok");
        assert_ne!(sig, url("/a", Operation::Read, "root").expected("tok"));
        assert_ne!(sig, url("/a", Operation::Write, "user").expected("tok"));
        assert_ne!(sig, url("/b", Operation::Read, "user").expected("tok"));
        assert_ne!(sig, url("/a", Operation::Read, "user").expected("other"));
        assert_eq!(url("/a", Operation::Read, "").user(), "user");
    }
}

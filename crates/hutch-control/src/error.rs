//! The control plane's errors, and the one place that maps them onto the
//! API's stable codes.

use hutch_api::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    Invalid(String),
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    #[error("no sandbox {0}")]
    NoSandbox(String),
    #[error("no template {0}")]
    NoTemplate(String),
    #[error("image {0:?} is neither `base`, a preset (python, node) nor in the image store (hutch image list)")]
    NoImage(String),
    #[error("you already have a template named {0:?}")]
    TemplateNameTaken(String),
    #[error("no process {pid} in sandbox {sandbox}")]
    NoProcess { sandbox: String, pid: u32 },
    #[error("sandbox {id} is {state}, not running; the command was not sent")]
    NotRunning { id: String, state: &'static str },
    #[error("all {0} command slots of the sandbox are in use; nothing was started")]
    Capacity(usize),
    #[error("this Idempotency-Key was used with a different request")]
    IdempotencyConflict,
    #[error("sandbox execution outcome is unknown; the command will not be repeated")]
    OutcomeUnknown,
    #[error("sandbox failed to start; command was not executed; reason: {0}")]
    StartFailed(String),
    #[error("the host cannot start another sandbox: {0}")]
    NoCapacity(String),
    /// A stored refusal replayed for its Idempotency-Key.
    #[error("{message}")]
    Replayed { code: ErrorCode, message: String },
    /// A file operation's refusal, already carrying its API code.
    #[error("{message}")]
    Files { code: ErrorCode, message: String },
    #[error("store: {0}")]
    Store(#[from] hutch_store::StoreError),
    #[error("sandbox {sandbox}: agent: {source}")]
    Agent { sandbox: String, source: hutch_runtime::agent::AgentError },
    #[error("runtime: {0}")]
    Runtime(String),
    #[error("shutting down")]
    ShuttingDown,
    /// The host cannot provide a feature the request needs.
    #[error("{0}")]
    FeatureUnavailable(String),
    /// The sandbox's `deny_all` policy forbids the request.
    #[error("sandbox {0} has no network (`deny_all`)")]
    NetworkIsolated(String),
    #[error(
        "an access token is required: send it in X-Hutch-Sandbox-Token, or POST it to <url>_hutch/access for a cookie"
    )]
    AccessTokenRequired,
    #[error("{0}")]
    AccessTokenInvalid(&'static str),
    #[error("the access token expired at {0}")]
    AccessTokenExpired(String),
    #[error("the access token is for another sandbox or port")]
    AccessTokenWrongTarget,
    #[error("sandbox {id} already has {max} live access grants; revoke some first")]
    AccessGrantCapacity { id: String, max: usize },
    #[error("no access grant {0}")]
    NoGrant(String),
    /// Nothing accepted a connection on the port (the message says which).
    #[error("{0}")]
    PortUnreachable(String),
    #[error("no build {0}")]
    NoBuild(String),
    /// A build's Dockerfile or context instruction that is not run.
    #[error("Dockerfile line {line}: {message}")]
    BuildRefused { line: usize, message: String },
    #[error("the template's startup command failed: {0}")]
    StartupFailed(String),
    #[error("the sandbox did not become ready: {0}")]
    ReadinessTimeout(String),
}

impl ControlError {
    /// The API code of each error: one exhaustive match, no wildcard.
    pub fn code(&self) -> ErrorCode {
        match self {
            ControlError::Invalid(_) => ErrorCode::InvalidRequest,
            ControlError::UnknownTemplate(_) => ErrorCode::UnknownTemplate,
            ControlError::NoSandbox(_)
            | ControlError::NoProcess { .. }
            | ControlError::NoTemplate(_)
            | ControlError::NoBuild(_) => ErrorCode::NotFound,
            ControlError::BuildRefused { .. } => ErrorCode::BuildInstructionRefused,
            ControlError::StartupFailed(_) => ErrorCode::SandboxStartupFailed,
            ControlError::ReadinessTimeout(_) => ErrorCode::SandboxReadinessTimeout,
            ControlError::TemplateNameTaken(_) => ErrorCode::TemplateNameTaken,
            ControlError::NoImage(_) => ErrorCode::ImageNotFound,
            ControlError::NotRunning { .. } => ErrorCode::SandboxSessionNotRunning,
            ControlError::Capacity(_) => ErrorCode::SandboxCommandCapacity,
            ControlError::IdempotencyConflict => ErrorCode::IdempotencyConflict,
            ControlError::OutcomeUnknown => ErrorCode::ExecutionOutcomeUnknown,
            ControlError::StartFailed(_) => ErrorCode::SandboxStartFailed,
            ControlError::NoCapacity(_) => ErrorCode::SandboxCapacityUnavailable,
            ControlError::Replayed { code, .. } => *code,
            ControlError::Files { code, .. } => *code,
            ControlError::Store(_) | ControlError::Agent { .. } | ControlError::Runtime(_) => ErrorCode::Internal,
            ControlError::ShuttingDown => ErrorCode::Unavailable,
            ControlError::FeatureUnavailable(_) => ErrorCode::FeatureUnavailable,
            ControlError::NetworkIsolated(_) => ErrorCode::SandboxNetworkIsolated,
            ControlError::AccessTokenRequired => ErrorCode::AccessTokenRequired,
            ControlError::AccessTokenInvalid(_) => ErrorCode::AccessTokenInvalid,
            ControlError::AccessTokenExpired(_) => ErrorCode::AccessTokenExpired,
            ControlError::AccessTokenWrongTarget => ErrorCode::AccessTokenWrongTarget,
            ControlError::AccessGrantCapacity { .. } => ErrorCode::AccessGrantCapacity,
            ControlError::NoGrant(_) => ErrorCode::NotFound,
            ControlError::PortUnreachable(_) => ErrorCode::SandboxPortUnreachable,
        }
    }

    /// The message shown to clients: internals of a 5xx are logged, never sent.
    pub fn public_message(&self) -> String {
        match self.code() {
            ErrorCode::Internal => "internal error; see the server log".to_owned(),
            _ => self.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, ControlError>;

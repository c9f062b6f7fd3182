//! A sandbox's ports by E2B's host names: `<port>-<sandbox>.<domain>`
//! under the operator's E2B domain (`hutch serve --e2b-domain`), which is
//! what the SDK's `get_host(port)` names. envd's port (49983) is this
//! daemon's envd API; any other goes to the sandbox through the port
//! proxy, checked by the control plane (`authorize_e2b_port`): public
//! sandboxes answer anyone who names them, the others want the sandbox's
//! traffic token in `e2b-traffic-access-token`; a paused sandbox with
//! auto-resume is resumed by the request. Errors are E2B's proxy's JSON.

use super::{E2bError, ENVD_PORT};
use crate::proxy::{Passing, Target};
use crate::App;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use hutch_api::ErrorCode;
use hutch_control::{ControlError, SandboxId};
use serde_json::json;

/// E2B's header of the traffic access token.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Serves a request for an E2B host name of a sandbox port; hands every
/// other request back (envd's port included, for the envd routes).
pub async fn by_host(app: &App, req: Request) -> Result<Response, Request> {
    let Some(domain) = app.control.e2b_domain() else { return Err(req) };
    let host = req.uri().host().map(str::to_owned).or_else(|| super::header(req.headers(), "host").map(str::to_owned));
    let Some((port, id)) = host.as_deref().and_then(|h| hutch_control::e2b::parse_host(h, domain)) else {
        return Err(req);
    };
    if port == ENVD_PORT {
        return Err(req);
    }
    Ok(serve(app, port, id, req).await)
}

async fn serve(app: &App, port: u16, id: SandboxId, mut req: Request) -> Response {
    let token = super::header(req.headers(), TRAFFIC_TOKEN_HEADER).map(str::to_owned);
    // The credential never reaches the application.
    req.headers_mut().remove(TRAFFIC_TOKEN_HEADER);
    let (pass, host) = match app.control.authorize_e2b_port(&id, port, token.as_deref()).await {
        Ok(p) => p,
        Err(e) => return refused(&id, port, e),
    };
    let path_and_query = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let path_and_query = if path_and_query.starts_with('/') { path_and_query.to_owned() } else { "/".to_owned() };
    let target = Target { sandbox: id.to_string(), port, path_and_query, base: "/".to_owned() };
    match crate::proxy::forward(app, &target, pass, req, Passing { host, policy: false }).await {
        Ok(resp) => resp,
        Err(e) if e.code == ErrorCode::SandboxPortUnreachable => port_closed(&id, port),
        Err(e) if e.code == ErrorCode::SandboxSessionNotRunning => not_found(&id),
        Err(e) => {
            let (_, status) = super::connect_code(e.code);
            answer(status, &id, e.message)
        }
    }
}

fn answer(status: StatusCode, id: &SandboxId, message: String) -> Response {
    let body = json!({"code": status.as_u16(), "message": message, "sandboxId": id.as_str()});
    (status, [(header::CACHE_CONTROL, "no-store")], axum::Json(body)).into_response()
}

fn not_found(id: &SandboxId) -> Response {
    answer(StatusCode::BAD_GATEWAY, id, format!("The sandbox {id} was not found"))
}

fn port_closed(id: &SandboxId, port: u16) -> Response {
    let mut resp = answer(StatusCode::BAD_GATEWAY, id, "The sandbox is running but port is not open".to_owned());
    if let Ok(v) = port.to_string().parse() {
        resp.headers_mut().insert("x-e2b-port", v);
    }
    resp
}

/// A refusal as E2B's proxy words it.
fn refused(id: &SandboxId, port: u16, e: ControlError) -> Response {
    match e {
        ControlError::NoSandbox(_) => not_found(id),
        ControlError::AccessTokenRequired => answer(
            StatusCode::FORBIDDEN,
            id,
            format!("Sandbox is secured with traffic access token. Token header '{TRAFFIC_TOKEN_HEADER}' is missing"),
        ),
        ControlError::AccessTokenInvalid(_) => answer(
            StatusCode::FORBIDDEN,
            id,
            format!(
                "Sandbox is secured with traffic access token. Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid"
            ),
        ),
        ControlError::NotRunning {
            state: hutch_api::SandboxState::Suspended | hutch_api::SandboxState::Paused, ..
        } => answer(
            StatusCode::CONFLICT,
            id,
            format!("The sandbox {id} is paused; resume it (or create it with auto_resume) to reach port {port}"),
        ),
        ControlError::NotRunning { .. } => not_found(id),
        ControlError::PortUnreachable(_) => port_closed(id, port),
        e => {
            let err = E2bError::from(e);
            answer(err.status, id, err.message)
        }
    }
}

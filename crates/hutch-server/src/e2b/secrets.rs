//! E2B's secrets API (`/secrets`), as the SDK's `Secret` class calls it:
//! create (`{"name", "value", "metadata"}`), list, get, update (a new
//! value, a new version) and destroy, by id or name, over the same secrets
//! as `/v1/secrets`. No answer holds a value. E2B's egress rules that name
//! `${e2b.secrets.NAME}` are not read: a secret is injected for the hosts
//! `/v1/secrets` gives it (see docs/e2b.md).

use super::control::{authenticate, body};
use super::E2bError;
use super::E2bPath as ApiPath;
use crate::routes::Caller;
use crate::App;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use hutch_control::secrets::SecretInfo;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

type AppState = State<Arc<App>>;
type E2bResult<T> = Result<T, E2bError>;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/secrets", get(list).post(create))
        .route("/secrets/{id}", get(get_one).post(update).delete(delete_one))
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

/// E2B's `NewSecret`.
#[derive(Deserialize, Default)]
struct NewSecret {
    #[serde(default)]
    name: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

/// E2B's `SecretUpdate`.
#[derive(Deserialize, Default)]
struct SecretUpdate {
    #[serde(default)]
    value: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

/// E2B's `Secret`.
fn view(s: &SecretInfo) -> Value {
    json!({
        "secretID": s.id,
        "name": s.name,
        "currentVersion": s.version,
        "metadata": s.metadata,
        "createdAt": s.created_at,
        "updatedAt": s.updated_at,
    })
}

/// A control error with E2B's 404 for a secret that is not the caller's.
fn mapped(reference: &str) -> impl Fn(hutch_control::ControlError) -> E2bError + '_ {
    move |e| match e.code() {
        hutch_api::ErrorCode::SecretNotFound => E2bError::new(
            StatusCode::NOT_FOUND,
            format!("secret '{}' not found", reference.chars().take(80).collect::<String>()),
        ),
        _ => E2bError::from(e),
    }
}

async fn create(State(app): AppState, Extension(caller): Extension<Caller>, req: Request) -> E2bResult<Response> {
    let new: NewSecret = body(req).await?;
    let s = app.control.e2b_create_secret(&caller, &new.name, &new.value, &new.metadata.unwrap_or_default()).await?;
    Ok((StatusCode::CREATED, Json(view(&s))).into_response())
}

async fn list(State(app): AppState, Extension(caller): Extension<Caller>) -> E2bResult<Json<Value>> {
    let list = app.control.e2b_secrets(&caller).await?;
    Ok(Json(Value::Array(list.iter().map(view).collect())))
}

async fn get_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<Json<Value>> {
    Ok(Json(view(&app.control.e2b_secret(&caller, &id).await.map_err(mapped(&id))?)))
}

async fn update(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<Json<Value>> {
    let u: SecretUpdate = body(req).await?;
    let s = app.control.e2b_update_secret(&caller, &id, &u.value, u.metadata.as_ref()).await.map_err(mapped(&id))?;
    Ok(Json(view(&s)))
}

async fn delete_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<StatusCode> {
    app.control.e2b_delete_secret(&caller, &id).await.map_err(mapped(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

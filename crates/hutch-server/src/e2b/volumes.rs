//! E2B's volume API (`/volumes`), as the SDK's `Volume` class calls it:
//! create (`{"name"}`, the size hutch's default), list, get and delete,
//! over the same `Control` operations as `/v1/volumes`. A sandbox mounts
//! them with `volumeMounts` at its creation (`control.rs`). E2B's volume
//! content API (files read and written without a sandbox, on a domain of
//! its own with the volume's token) is not served: the token answered is
//! empty, and its routes answer E2B's 404.

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
use hutch_api::{CreateVolume, Volume};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

type AppState = State<Arc<App>>;
type E2bResult<T> = Result<T, E2bError>;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/volumes", get(list).post(create))
        .route("/volumes/{id}", get(get_one).delete(delete_one))
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

/// E2B's `NewVolume`.
#[derive(Deserialize, Default)]
struct NewVolume {
    #[serde(default)]
    name: String,
}

/// E2B's `VolumeAndToken`.
fn with_token(v: &Volume) -> Value {
    json!({"volumeID": v.id, "name": v.name, "token": ""})
}

fn not_found(reference: &str) -> E2bError {
    E2bError::new(
        StatusCode::NOT_FOUND,
        format!("volume '{}' not found", reference.chars().take(80).collect::<String>()),
    )
}

/// A control error with E2B's 404 for a volume that is not the caller's.
fn mapped(reference: &str) -> impl Fn(hutch_control::ControlError) -> E2bError + '_ {
    move |e| match e.code() {
        hutch_api::ErrorCode::VolumeNotFound => not_found(reference),
        _ => E2bError::from(e),
    }
}

async fn create(State(app): AppState, Extension(caller): Extension<Caller>, req: Request) -> E2bResult<Response> {
    let new: NewVolume = body(req).await?;
    let v = app.control.create_volume(&caller, &CreateVolume { name: new.name, size_mib: None }).await?;
    Ok((StatusCode::CREATED, Json(with_token(&v))).into_response())
}

async fn list(State(app): AppState, Extension(caller): Extension<Caller>) -> E2bResult<Json<Value>> {
    let list = app.control.list_volumes(&caller, None).await?;
    Ok(Json(Value::Array(list.volumes.iter().map(|v| json!({"volumeID": v.id, "name": v.name})).collect())))
}

async fn get_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<Json<Value>> {
    let v = app.control.get_volume(&caller, &id).await.map_err(mapped(&id))?;
    Ok(Json(with_token(&v)))
}

async fn delete_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<StatusCode> {
    app.control.delete_volume(&caller, &id).await.map_err(mapped(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

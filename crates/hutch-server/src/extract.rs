//! Extractors whose every refusal is the API's JSON error body: path
//! parameters (a malformed one names nothing: `not_found`) and query
//! strings (`invalid_request`).

use crate::ApiError;
use axum::extract::{FromRequestParts, Path, Query};
use axum::http::request::Parts;
use hutch_api::ErrorCode;
use serde::de::DeserializeOwned;

/// Path parameters.
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::new(ErrorCode::NotFound, format!("nothing is at this path: {}", e.body_text()))),
        }
    }
}

/// A query string.
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(ApiError::invalid(e.body_text())),
        }
    }
}

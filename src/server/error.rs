//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with a status
//! that says whose fault it was. Every refusal goes through here, so a client always gets a body
//! it can show, and the server carries on with the next request.

use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The OpenAI error type: `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid_request(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: None, code: None }
    }

    /// An invalid value of one request field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), code: Some("invalid_value"), ..Self::invalid_request(message) }
    }

    pub fn unknown_model(requested: &str, served: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::invalid_request(format!("the model `{requested}` does not exist; this server serves `{served}`"))
        }
    }

    pub fn context_length_exceeded(message: impl Into<String>) -> Self {
        ApiError { param: Some("messages".into()), code: Some("context_length_exceeded"), ..Self::invalid_request(message) }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid or missing API key; send it as `Authorization: Bearer KEY`".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(path: &str) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, code: Some("not_found"), ..Self::invalid_request(format!("no route for {path}")) }
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            code: Some("method_not_allowed"),
            ..Self::invalid_request(format!("{path} does not take {method} requests"))
        }
    }

    pub fn payload_too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: Some("request_too_large"),
            ..Self::invalid_request(format!("the request body is larger than the limit of {limit} bytes"))
        }
    }

    /// The engine is gone (shut down or crashed): retrying later on a restarted server may work.
    pub fn engine_unavailable() -> Self {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: "the inference engine is not running".into(), kind: "server_error", param: None, code: None }
    }

    /// A generation that ended with an error after the request was accepted.
    pub fn generation_failed(message: impl Into<String>) -> Self {
        ApiError { code: Some("generation_failed"), ..Self::internal(message) }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// The request body limit, stored in the router state so the 413 message can name it.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// A request body type whose type errors are reported with the field at fault (`param`), as
/// OpenAI does.
pub trait RequestBody: serde::de::DeserializeOwned {
    /// The field of `body` at fault when deserializing `Self` fails where the error's own path
    /// cannot tell (inside `#[serde(flatten)]`ed fields, which serde reads from a buffer).
    fn locate_error(body: &serde_json::Value) -> Option<String>;
}

/// Deserializes `body`, naming the field of any type error: `temperature`, `messages[0].content`.
pub fn deserialize_named<T: RequestBody>(body: serde_json::Value) -> Result<T, ApiError> {
    match serde_path_to_error::deserialize::<_, T>(&body) {
        Ok(value) => Ok(value),
        Err(err) => {
            let path = err.path().to_string();
            let message = err.into_inner().to_string();
            let param = if path != "." { Some(path) } else { T::locate_error(&body).or_else(|| missing_field(&message)) };
            let what = match &param {
                Some(field) => format!("invalid request body: `{field}`: {message}"),
                None => format!("invalid request body: {message}"),
            };
            Err(ApiError { param, code: Some("invalid_type"), ..ApiError::invalid_request(what) })
        }
    }
}

/// The field serde names in "missing field `model`".
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split_once('`').map(|(field, _)| field.to_string())
}

/// A JSON body whose every failure is an [`ApiError`]: 413 past the body limit, 400 otherwise
/// (malformed JSON; wrong field types, naming the field). Unlike `axum::Json`, a missing
/// `Content-Type` is accepted, as `curl -d` users forget it.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: RequestBody,
    BodyLimit: axum::extract::FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let limit: BodyLimit = axum::extract::FromRef::from_ref(state);
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(limit.0)
            } else {
                ApiError::invalid_request(format!("cannot read the request body: {rejection}"))
            }
        })?;
        let body: serde_json::Value = serde_json::from_slice(&bytes).map_err(|err| ApiError::invalid_request(format!("malformed JSON in the request body: {err}")))?;
        deserialize_named(body).map(ApiJson)
    }
}

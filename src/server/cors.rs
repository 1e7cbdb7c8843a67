//! Cross-origin requests from browsers (CORS), for the origins `--allowed-origins` names.
//! Without any, responses carry no CORS headers and browsers keep other sites out.

use axum::http::{HeaderValue, Method};
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CorsError {
    #[error("`{0}` is not an origin: write it as a browser sends it, scheme and host with an optional port (http://localhost:3000), or * for any")]
    BadOrigin(String),
}

/// The layer answering preflight requests and marking responses for `origins` (`*` allows any);
/// `None` when the list is empty.
pub fn layer(origins: &[String]) -> Result<Option<CorsLayer>, CorsError> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow_origin = if origins.iter().any(|o| o.trim() == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().map(|o| origin(o)).collect::<Result<Vec<_>, _>>()?)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods([Method::GET, Method::POST])
            // Clients send their own headers (the OpenAI SDKs add several): whatever a preflight
            // asks for is allowed, `Authorization` included, which a `*` would not cover.
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(Duration::from_secs(600)),
    ))
}

/// An origin as browsers send it in the `Origin` header: `scheme://host[:port]`, no path.
fn origin(text: &str) -> Result<HeaderValue, CorsError> {
    let trimmed = text.trim().trim_end_matches('/');
    let bad = || CorsError::BadOrigin(text.to_string());
    let (scheme, rest) = trimmed.split_once("://").ok_or_else(bad)?;
    if scheme.is_empty() || rest.is_empty() || rest.contains('/') || !scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) {
        return Err(bad());
    }
    HeaderValue::from_str(trimmed).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_checked() {
        assert!(layer(&[]).expect("empty is fine").is_none());
        assert!(layer(&["*".into()]).expect("any").is_some());
        assert!(layer(&["http://localhost:3000".into(), "https://example.com/".into()]).expect("valid").is_some());
        for bad in ["localhost:3000", "http://", "http://example.com/app", "", "ht tp://x"] {
            assert_eq!(layer(&[bad.to_string()]).err(), Some(CorsError::BadOrigin(bad.to_string())), "{bad}");
        }
    }
}

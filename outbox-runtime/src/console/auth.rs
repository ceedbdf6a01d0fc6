//! Who may act: the token (cookie or `Authorization: Bearer`), and the checks against requests
//! forged by another site.

use axum::http::{header, HeaderMap};

use super::Console;

/// The cookie that carries the token once an operator signed in.
pub(super) const COOKIE: &str = "outbox_console_token";

/// Why an action is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The console was started without actions.
    ReadOnly,
    /// No token, or the wrong one.
    NoToken,
    /// From another site, or without the form's anti-forgery field.
    Forged,
}

/// Compares without an early exit, so that the time taken says nothing about the token.
pub(super) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// Whether the request carries the token (actions allowed).
pub(super) fn signed_in(console: &Console, headers: &HeaderMap) -> bool {
    let Some(token) = console.settings.token.as_deref() else {
        return false;
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    bearer.is_some_and(|b| same(b.trim(), token))
        || cookie(headers).is_some_and(|c| same(&c, token))
}

/// The token cookie's value, if the request has one.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then(|| {
                form_urlencoded::parse(format!("v={value}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default()
            })
        })
}

/// Whether the request comes from a page of this console: `Sec-Fetch-Site` (sent by browsers)
/// says same-origin or none, and `Origin`, when sent, names the host the request went to.
/// Requests without either (scripts, curl) pass: they carry no browser's cookies unasked.
pub(super) fn same_origin(headers: &HeaderMap) -> bool {
    let get = |name| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site") {
        if site != "same-origin" && site != "none" {
            return false;
        }
    }
    match (get("origin"), get("host")) {
        (Some("null"), _) => false,
        (Some(origin), Some(host)) => origin
            .split_once("://")
            .is_some_and(|(_, authority)| authority.trim_end_matches('/') == host),
        (Some(_), None) => false,
        (None, _) => true,
    }
}

/// Whether an action may run: actions allowed, the token, from this console's own pages (and,
/// for a browser's form, with the anti-forgery field).
pub(super) fn may_act(
    console: &Console,
    headers: &HeaderMap,
    form_key: Option<&str>,
) -> Result<(), Refusal> {
    if !console.settings.actions_allowed() {
        return Err(Refusal::ReadOnly);
    }
    if !signed_in(console, headers) {
        return Err(Refusal::NoToken);
    }
    let bearer = headers.contains_key(header::AUTHORIZATION);
    let key_ok = form_key.is_some_and(|k| same(k, &console.form_key));
    if !same_origin(headers) || !(bearer || key_ok) {
        return Err(Refusal::Forged);
    }
    Ok(())
}

/// The `Set-Cookie` value that signs in (or, with `None`, out).
pub(super) fn set_cookie(console: &Console, token: Option<&str>) -> String {
    let path = console.link("/");
    match token {
        Some(token) => {
            let value: String = form_urlencoded::byte_serialize(token.as_bytes()).collect();
            format!("{COOKIE}={value}; Path={path}; HttpOnly; SameSite=Strict")
        }
        None => format!("{COOKIE}=; Path={path}; HttpOnly; SameSite=Strict; Max-Age=0"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn same_compares_whole_strings() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
        assert!(!same("", "a"));
    }

    #[test]
    fn another_sites_requests_are_not_same_origin() {
        assert!(same_origin(&headers(&[("host", "127.0.0.1:8080")])));
        assert!(same_origin(&headers(&[
            ("host", "127.0.0.1:8080"),
            ("origin", "http://127.0.0.1:8080"),
            ("sec-fetch-site", "same-origin"),
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:8080"),
            ("origin", "http://evil.example"),
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:8080"),
            ("sec-fetch-site", "cross-site"),
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:8080"),
            ("origin", "null"),
        ])));
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let h = headers(&[("cookie", "a=1; outbox_console_token=s%3Dcret%20x; b=2")]);
        assert_eq!(cookie(&h).as_deref(), Some("s=cret x"));
        assert_eq!(cookie(&headers(&[("cookie", "a=1")])), None);
    }
}

//! Who may act: the token (cookie or `Authorization: Bearer`), and the checks against requests
//! forged by another site.

use axum::http::{header, HeaderMap, Uri};

use crate::console::Console;

/// The cookie that carries the token once an operator signed in.
pub(in crate::console) const COOKIE: &str = "outbox_console_token";

/// Why an action is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::console) enum Refusal {
    /// The console was started without actions.
    ReadOnly,
    /// No token, or the wrong one.
    NoToken,
    /// From another site, or without the form's anti-forgery field.
    Forged,
}

/// Whether `given` is `secret`, in a time that depends on `given`'s length alone: no early
/// exit, not even on a length that differs.
pub(in crate::console) fn same(given: &str, secret: &str) -> bool {
    let secret = secret.as_bytes();
    if secret.is_empty() {
        return given.is_empty();
    }
    let differ = given
        .bytes()
        .enumerate()
        .fold(0u8, |diff, (i, x)| diff | (x ^ secret[i % secret.len()]));
    differ == 0 && given.len() == secret.len()
}

/// Whether the request carries the token (actions allowed): a bearer token or the cookie.
pub(in crate::console) fn signed_in(console: &Console, headers: &HeaderMap) -> bool {
    let cookie_ok = || {
        let token = console.settings.token.as_deref();
        token.is_some_and(|t| cookie(headers).is_some_and(|c| same(&c, t)))
    };
    bearer(console, headers) || cookie_ok()
}

/// Whether the request carries the token as `Authorization: Bearer` (a script's request: no
/// browser sends it unasked).
fn bearer(console: &Console, headers: &HeaderMap) -> bool {
    let Some(token) = console.settings.token.as_deref() else {
        return false;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|b| same(b.trim(), token))
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
/// says same-origin or none, and `Origin`, when sent, names the host the request went to (its
/// `Host` header, or under HTTP/2 its URI's authority). Requests without either (scripts, curl)
/// pass: they carry no browser's cookies unasked.
pub(in crate::console) fn same_origin(headers: &HeaderMap, uri: &Uri) -> bool {
    let get = |name| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site") {
        if site != "same-origin" && site != "none" {
            return false;
        }
    }
    let host = get("host").or_else(|| uri.authority().map(|a| a.as_str()));
    match (get("origin"), host) {
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
pub(in crate::console) fn may_act(
    console: &Console,
    headers: &HeaderMap,
    uri: &Uri,
    form_key: Option<&str>,
) -> Result<(), Refusal> {
    if !console.settings.actions_allowed() {
        return Err(Refusal::ReadOnly);
    }
    if !signed_in(console, headers) {
        return Err(Refusal::NoToken);
    }
    // The cookie comes with any request the browser sends; the form's field only from a page
    // of this console. A bearer token is never sent unasked.
    let key_ok = form_key.is_some_and(|k| same(k, &console.form_key));
    if !same_origin(headers, uri) || !(bearer(console, headers) || key_ok) {
        return Err(Refusal::Forged);
    }
    Ok(())
}

/// The `Set-Cookie` value that signs in (or, with `None`, out).
pub(in crate::console) fn set_cookie(console: &Console, token: Option<&str>) -> String {
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
        assert!(
            !same("abcabc", "abc"),
            "a repeat of the secret is not the secret"
        );
        assert!(same("", ""));
    }

    #[test]
    fn another_sites_requests_are_not_same_origin() {
        let uri = Uri::from_static("/parked/retry");
        let same_origin = |h: &HeaderMap| same_origin(h, &uri);
        assert!(same_origin(&headers(&[("host", "127.0.0.1:8080")])));
        // HTTP/2: no Host header, the authority in the URI.
        let h2 = Uri::from_static("https://ops.example:8443/parked/retry");
        assert!(super::same_origin(
            &headers(&[("origin", "https://ops.example:8443")]),
            &h2
        ));
        assert!(!super::same_origin(
            &headers(&[("origin", "https://evil.example")]),
            &h2
        ));
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

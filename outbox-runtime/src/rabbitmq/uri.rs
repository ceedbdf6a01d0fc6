//! AMQP URIs as RabbitMQ documents them (`amqp[s]://user:password@host:port/vhost?query`),
//! parsed here rather than by the client: the user, password and vhost are percent-decoded
//! (`/%2f` is the vhost `/`, a password may hold `@` as `%40`), and a query the client would
//! panic on (a parameter without `=`) is an error that says so.

/// What an AMQP URI says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Uri {
    pub(crate) tls: bool,
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) user: String,
    pub(crate) password: String,
    pub(crate) vhost: String,
    /// `cacertfile`, `certfile`, `keyfile` (TLS), `heartbeat` (seconds).
    pub(crate) query: Vec<(String, String)>,
}

/// The query parameters understood.
const KNOWN: [&str; 4] = ["cacertfile", "certfile", "keyfile", "heartbeat"];

impl Uri {
    /// The value of query parameter `name`, if given.
    pub(crate) fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Parses `url`; `Err` says what is wrong with it (never showing the password).
pub(crate) fn parse(url: &str) -> Result<Uri, String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or("it must start with amqp:// or amqps://")?;
    let (tls, default_port) = match scheme.to_ascii_lowercase().as_str() {
        "amqp" => (false, 5672),
        "amqps" => (true, 5671),
        other => return Err(format!("the scheme `{other}` is not amqp or amqps")),
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match rest.find('/') {
        Some(at) => (&rest[..at], &rest[at..]),
        None => (rest, ""),
    };
    let (user_info, host_port) = match authority.rsplit_once('@') {
        Some((user_info, host_port)) => (Some(user_info), host_port),
        None => (None, authority),
    };
    let (user, password) = match user_info {
        None => ("guest".to_owned(), "guest".to_owned()),
        Some(info) => {
            let (user, password) = info.split_once(':').unwrap_or((info, ""));
            (decode(user, "user")?, decode(password, "password")?)
        }
    };
    let (host, port) = host_and_port(host_port)?;
    let vhost = match path {
        "" | "/" => "/".to_owned(),
        path if path[1..].contains('/') => {
            return Err(format!(
                "the path `{path}` is not one vhost: write a `/` in a vhost's name as %2f"
            ))
        }
        path => decode(&path[1..], "vhost")?,
    };
    let mut params = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("the query parameter `{pair}` has no value (`name=value`)"))?;
        let key = decode(key, "query parameter")?;
        if !KNOWN.contains(&key.as_str()) {
            return Err(format!(
                "the query parameter `{key}` is not one of {}",
                KNOWN.join(", ")
            ));
        }
        params.push((key, decode(value, "query parameter")?));
    }
    Ok(Uri {
        tls,
        host,
        port: port.unwrap_or(default_port),
        user,
        password,
        vhost,
        query: params,
    })
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn host_and_port(text: &str) -> Result<(String, Option<u16>), String> {
    let (host, port) = if let Some(v6) = text.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or("an IPv6 address must end with `]`")?;
        match after {
            "" => (host, None),
            after => (
                host,
                Some(after.strip_prefix(':').ok_or("`:` must follow `]`")?),
            ),
        }
    } else {
        match text.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        }
    };
    if host.is_empty() {
        return Err("it names no host".into());
    }
    let port = match port {
        None | Some("") => None,
        Some(port) => Some(
            port.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("the port `{port}` is not a port number"))?,
        ),
    };
    Ok((host.to_owned(), port))
}

/// Percent-decodes `text` (UTF-8); `what` names it in the error.
fn decode(text: &str, what: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("the {what} has a `%` not followed by two hex digits"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("the {what} is not UTF-8 once decoded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_password_and_vhost_are_percent_decoded() {
        let uri = parse("amqp://app:p%40ss%3Aw@mq.internal:5673/%2f").unwrap();
        assert_eq!(uri.user, "app");
        assert_eq!(uri.password, "p@ss:w");
        assert_eq!(uri.host, "mq.internal");
        assert_eq!(uri.port, 5673);
        assert_eq!(uri.vhost, "/");
        assert!(!uri.tls);
        let uri = parse("amqps://mq/prod%2Fpayments?cacertfile=/etc/ca.pem").unwrap();
        assert_eq!(
            (uri.user.as_str(), uri.password.as_str()),
            ("guest", "guest")
        );
        assert_eq!(uri.port, 5671);
        assert_eq!(uri.vhost, "prod/payments");
        assert_eq!(uri.param("cacertfile"), Some("/etc/ca.pem"));
        assert!(uri.tls);
        let uri = parse("amqp://u:p@[::1]:5680").unwrap();
        assert_eq!(
            (uri.host.as_str(), uri.port, uri.vhost.as_str()),
            ("::1", 5680, "/")
        );
        assert_eq!(parse("amqp://h/").unwrap().vhost, "/");
    }

    #[test]
    fn what_cannot_be_used_is_said() {
        for (url, expected) in [
            ("http://h", "not amqp or amqps"),
            ("127.0.0.1:5672", "must start with"),
            ("amqp://u:p@", "no host"),
            ("amqp://h:99999", "not a port number"),
            ("amqp://h:0", "not a port number"),
            ("amqp://h/a/b", "not one vhost"),
            ("amqp://h?heartbeat", "has no value"),
            ("amqp://h?frame_max=1", "not one of"),
            ("amqp://u:%zz@h", "password has a `%`"),
            ("amqp://[::1", "must end with"),
        ] {
            let err = parse(url).unwrap_err();
            assert!(err.contains(expected), "{url}: {err}");
        }
    }
}

//! TLS to RabbitMQ (`amqps://`, feature `rabbitmq-tls`): rustls with the ring provider, the
//! server checked against the given CA certificates (else the web's roots), an optional client
//! certificate. Built here rather than by the client, whose own builder panics on a
//! certificate or key it cannot use: here that is an error naming the file.

use std::path::Path;
use std::sync::Arc;

use amqprs::tls::TlsAdaptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;

/// The TLS settings for a connection to `host`.
pub(crate) fn adaptor(
    host: &str,
    ca: Option<&Path>,
    client: Option<(&Path, &Path)>,
) -> Result<TlsAdaptor, String> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            for cert in certificates(path)? {
                roots.add(cert).map_err(|e| {
                    format!(
                        "the CA certificate in {} cannot be used: {e}",
                        path.display()
                    )
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certificates(cert)?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| format!("no private key could be read from {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("the client certificate cannot be used: {e}"))?
        }
    };
    ServerName::try_from(host.to_owned()).map_err(|_| {
        format!("`{host}` is not a name a server's certificate can be checked against")
    })?;
    Ok(TlsAdaptor::new(
        TlsConnector::from(Arc::new(config)),
        host.to_owned(),
    ))
}

/// The PEM certificates in `path`: at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let read = |e: rustls::pki_types::pem::Error| {
        format!("no certificate could be read from {}: {e}", path.display())
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

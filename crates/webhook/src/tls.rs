//! The serving certificate, reloaded when its files change: cert-manager renews it into a
//! Secret, kubelet swaps the Secret volume's files (a symlink flip), and the next handshake gets
//! the new pair, without a restart. A pair that does not load (a key that is not the
//! certificate's, caught between the two files' updates; a half-written file) leaves the served
//! one in place and is reported once, until the files change again.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use rustls::crypto::ring;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

/// Why a certificate and key did not load.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: no PEM certificate in it ({why})")]
    NoCertificate { path: PathBuf, why: String },
    #[error("{path}: no usable PEM private key in it ({why})")]
    NoKey { path: PathBuf, why: String },
    #[error("{key} is not the key of the certificate in {cert}")]
    Mismatch { cert: PathBuf, key: PathBuf },
}

/// The files' identity: a change of any of them is a change of the files.
type Stamp = Vec<(u64, u64, i64, i64, u64)>;

/// The certificate and key files, and the pair loaded from them.
#[derive(Debug)]
pub struct Certificates {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files as last tried, loaded or not.
    tried: Mutex<Stamp>,
}

/// What [`Certificates::reload`] did.
#[derive(Debug)]
pub enum Reload {
    Unchanged,
    Loaded,
    /// The files changed but do not load; the served pair stays.
    Failed(Error),
}

impl Certificates {
    /// Loads the pair from `cert` and `key` (PEM), or says what is wrong with them.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, Error> {
        let tried = stamp(cert, key);
        let pair = load_pair(cert, key)?;
        Ok(Certificates {
            cert: cert.to_owned(),
            key: key.to_owned(),
            current: RwLock::new(Arc::new(pair)),
            tried: Mutex::new(tried),
        })
    }

    /// Loads the pair again if the files changed since they were last tried.
    pub fn reload(&self) -> Reload {
        let now = stamp(&self.cert, &self.key);
        {
            let mut tried = self.tried.lock().expect("not poisoned");
            if *tried == now {
                return Reload::Unchanged;
            }
            *tried = now;
        }
        match load_pair(&self.cert, &self.key) {
            Ok(pair) => {
                *self.current.write().expect("not poisoned") = Arc::new(pair);
                Reload::Loaded
            }
            Err(e) => Reload::Failed(e),
        }
    }

    /// A TLS server configuration that serves the current pair at every handshake, speaking
    /// HTTP/2 (the API server asks for it) and HTTP/1.1. No session is resumed: a resumed
    /// session would go on under the certificate it began with, after a rotation (the API
    /// server's client does not resume anyway).
    pub fn server_config(self: &Arc<Self>) -> ServerConfig {
        let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("not poisoned").clone())
    }
}

fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, Error> {
    let read = |path: &Path| {
        fs::read(path).map_err(|source| Error::Read { path: path.to_owned(), source })
    };
    let (cert_pem, key_pem) = (read(cert)?, read(key)?);
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::NoCertificate { path: cert.to_owned(), why: e.to_string() })?;
    if chain.is_empty() {
        let why = "no CERTIFICATE block".to_owned();
        return Err(Error::NoCertificate { path: cert.to_owned(), why });
    }
    let no_key = |why: String| Error::NoKey { path: key.to_owned(), why };
    let der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| no_key(e.to_string()))?;
    let signer = ring::sign::any_supported_type(&der).map_err(|e| no_key(e.to_string()))?;
    let pair = CertifiedKey::new(chain, signer);
    pair.keys_match()
        .map_err(|_| Error::Mismatch { cert: cert.to_owned(), key: key.to_owned() })?;
    Ok(pair)
}

/// Device, inode, modification time (s, ns) and size of each file, following symlinks (the
/// Secret volume's `..data` flip changes the inode); zeros for a file that cannot be read.
fn stamp(cert: &Path, key: &Path) -> Stamp {
    [cert, key]
        .iter()
        .map(|p| {
            fs::metadata(p).map_or((0, 0, 0, 0, 0), |m| {
                (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size())
            })
        })
        .collect()
}

//! A pod's own `/etc` files: `ip netns exec NS` bind-mounts the files of `/etc/netns/NS/` over
//! `/etc`, so a resolv.conf written there is the one the pod's resolvers read.

use std::path::{Path, PathBuf};

/// `/etc/netns/NS/`, removed on drop.
pub struct NetnsEtc(PathBuf);

impl NetnsEtc {
    /// Gives namespace `ns` the resolv.conf `text`.
    pub fn resolv_conf(ns: &str, text: &str) -> NetnsEtc {
        let dir = Path::new("/etc/netns").join(ns);
        std::fs::create_dir_all(&dir).expect("create /etc/netns/NS");
        let guard = NetnsEtc(dir);
        std::fs::write(guard.0.join("resolv.conf"), text).expect("write resolv.conf");
        guard
    }
}

impl Drop for NetnsEtc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

//! The deployment files: `manifests/` (a kustomize base, its overlay for the link-local shape,
//! and the patches of node-local-dns's own DaemonSet), the `Dockerfile` and
//! `packaging/nodelocaldns-ha.service`, checked without a cluster, an image build or systemd.
//!
//! * Every YAML document parses into the k8s-openapi type of its `kind`, and nothing in it is
//!   dropped on the way back out (a misspelt or misplaced field would be).
//! * What `kustomize build` would do: every resource and patch a kustomization names exists and
//!   parses, every patch targets an object of the build, the `images` transformer applies. With
//!   `kubectl` on the machine, its built-in kustomize builds all of them for real, too.
//! * The agent's DaemonSet keeps its promises (capabilities, probes on the metrics address,
//!   settings that `nodelocaldns-ha run` accepts), and creates none of node-local-dns's objects.
//! * The patches of node-local-dns (manifests/node-local-dns) give node-cache the flags and the
//!   `drain` preStop hook the agent relies on, on every flavour's DaemonSet (upstream's,
//!   deliveryhero's, kubespray's), name no object (so they fit each one's name), and their
//!   removal takes the drain out again.
//! * The link-local overlay changes exactly one thing: the agent loses the kube-dns ClusterIP.
//!   Its patch refuses a base it was not written for, and its placeholder fill leaves the agent
//!   validated in the link-local shape.
//! * The systemd unit and the Dockerfile say what the issue asked, consistently with the
//!   manifests.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Probe, Service, ServiceAccount, Volume,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use nodelocaldns_ha::cli::Cli;
use nodelocaldns_ha::config::parse_duration;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

const NAMESPACE: &str = "kube-system";
const AGENT: &str = "nodelocaldns-ha";
/// The image name the manifests use, mapped to a real image by each kustomization's `images`.
const IMAGE: &str = "nodelocaldns-ha";
/// node-local-dns's DaemonSet in upstream's manifest, which the patches' examples name.
const NODE_LOCAL_DNS: &str = "node-local-dns";
/// The patches of node-local-dns's DaemonSet, under manifests/.
const NODE_LOCAL_DNS_PATCHES: &str = "node-local-dns";
const NODE_CACHE: &str = "node-cache";
const STATE_DIR: &str = "/run/nodelocaldns-ha";
const XTABLES_LOCK: &str = "/run/xtables.lock";
/// Where the Dockerfile puts the self-contained client that the drain patch copies out.
const CLIENT_BUNDLE: &str = "/opt/nodelocaldns-ha";
/// The capabilities the agent may ask for. NET_ADMIN: nftables, sock_diag, iptables changes.
/// NET_RAW: iptables-legacy (libiptc) works through a raw socket; without it the agent cannot
/// even read an iptables-legacy node (`iptables-legacy-save`: "Permission denied").
/// NET_BIND_SERVICE: the link-local forwarder listens on port 53.
const CAPABILITIES: [&str; 3] = ["NET_ADMIN", "NET_RAW", "NET_BIND_SERVICE"];
/// How much longer than its `--timeout` the `drain` client waits for the agent's answer
/// (`CALL_TIMEOUT` in src/bin/nodelocaldns-ha/main.rs).
const DRAIN_CALL_SLACK: Duration = Duration::from_secs(5);
/// What node-cache keeps of the grace period, at least, after the longest drain.
const NODE_CACHE_SHUTDOWN: Duration = Duration::from_secs(5);
/// The values of node-local-dns's placeholders in the manifests' comments (and its docs).
const PLACEHOLDERS: [(&str, &str); 3] = [
    ("__PILLAR__LOCAL__DNS__", "169.254.20.10"),
    ("__PILLAR__DNS__SERVER__", "10.96.0.10"),
    ("__PILLAR__DNS__DOMAIN__", "cluster.local"),
];
/// node-local-dns's link-local IP in the link-local shape's examples: kubespray's
/// `nodelocaldns_ip` (manifests/README.md's worked example).
const LINK_LOCAL_IP: &str = "169.254.25.10";
/// The placeholders node-cache fills itself when it writes its Corefile (its upstream's
/// ClusterIP, the node's resolvers): left as they are by every fill here.
const NODE_CACHE_FILLS: [&str; 2] = ["__PILLAR__CLUSTER__DNS__", "__PILLAR__UPSTREAM__SERVERS__"];
/// The kustomize components under manifests/ (`kind: Component`): the alerting rules as a
/// PrometheusRule, whose resources the document check reads.
const COMPONENTS: [&str; 5] = [
    "cluster-reports",
    "cluster-reports/startup-taint",
    "monitoring",
    "monitoring/node-local-dns",
    "webhook",
];
/// Prometheus's own files under manifests/, checked by promtool (tests/alerts.rs): the rules
/// and their unit tests.
const PROMETHEUS_FILES: [&str; 2] = ["monitoring/alerts.yaml", "monitoring/alerts_test.yaml"];
/// Every kustomization under manifests/: the agent in the ClusterIP shape (the base) and in the
/// link-local shape (its overlay).
const KUSTOMIZATIONS: [&str; 2] = ["base", "overlays/agent-link-local"];
/// The keys a kustomization here may use: anything else is a typo kustomize would reject.
const KUSTOMIZATION_KEYS: [&str; 8] =
    ["apiVersion", "kind", "resources", "patches", "images", "namespace", "labels", "components"];

/// node-local-dns's ConfigMap and DaemonSet as upstream's manifest has them (abridged to what
/// the patches touch and the placeholders fill). node-cache fills `__PILLAR__CLUSTER__DNS__` and
/// `__PILLAR__UPSTREAM__SERVERS__` itself when it writes its Corefile.
const STOCK_NODE_LOCAL_DNS: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata:
  name: node-local-dns
  namespace: kube-system
data:
  Corefile: |
    __PILLAR__DNS__DOMAIN__:53 {
        errors
        cache {
                success 9984 30
                denial 9984 5
        }
        reload
        loop
        bind __PILLAR__LOCAL__DNS__ __PILLAR__DNS__SERVER__
        forward . __PILLAR__CLUSTER__DNS__ {
                force_tcp
        }
        prometheus :9253
        health __PILLAR__LOCAL__DNS__:8080
        }
    .:53 {
        errors
        cache 30
        reload
        loop
        bind __PILLAR__LOCAL__DNS__ __PILLAR__DNS__SERVER__
        forward . __PILLAR__UPSTREAM__SERVERS__
        prometheus :9253
        }
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: node-local-dns
  namespace: kube-system
  labels:
    k8s-app: node-local-dns
spec:
  selector:
    matchLabels:
      k8s-app: node-local-dns
  template:
    metadata:
      labels:
        k8s-app: node-local-dns
    spec:
      priorityClassName: system-node-critical
      serviceAccountName: node-local-dns
      hostNetwork: true
      dnsPolicy: Default
      containers:
        - name: node-cache
          image: registry.k8s.io/dns/k8s-dns-node-cache:1.26.4
          args: ["-localip", "__PILLAR__LOCAL__DNS__,__PILLAR__DNS__SERVER__", "-conf",
                 "/etc/Corefile", "-upstreamsvc", "kube-dns-upstream"]
          ports:
            - {containerPort: 53, name: dns, protocol: UDP}
            - {containerPort: 53, name: dns-tcp, protocol: TCP}
            - {containerPort: 9253, name: metrics, protocol: TCP}
          livenessProbe:
            httpGet:
              host: __PILLAR__LOCAL__DNS__
              path: /health
              port: 8080
          securityContext:
            capabilities:
              add: ["NET_ADMIN"]
          volumeMounts:
            - name: xtables-lock
              mountPath: /run/xtables.lock
      volumes:
        - name: xtables-lock
          hostPath:
            path: /run/xtables.lock
            type: FileOrCreate
"#;

// ---------------------------------------------------------------------------------------------
// Files and documents

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `path` relative to the repository, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(repo()).unwrap_or(path).display().to_string()
}

/// Every `.yaml`/`.yml` file under `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The documents of a YAML stream, as JSON values; empty documents are left out.
fn yaml_docs(text: &str, origin: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}")))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn file_docs(path: &Path) -> Vec<Value> {
    yaml_docs(&read(path), &shown(path))
}

fn str_at<'a>(doc: &'a Value, pointer: &str) -> Option<&'a str> {
    doc.pointer(pointer).and_then(Value::as_str)
}

/// `value` as `T`, checking that serializing `T` back keeps everything `value` said: k8s-openapi
/// types ignore unknown fields, so a misspelt or misplaced field shows up as dropped here.
fn try_typed<T: DeserializeOwned + Serialize>(value: &Value) -> Result<T, String> {
    let typed: T = serde_json::from_value(value.clone())
        .map_err(|e| format!("not a valid {}: {e}", std::any::type_name::<T>()))?;
    let back = serde_json::to_value(&typed).unwrap();
    let mut lost = Vec::new();
    kept(value, &back, "", &mut lost);
    match lost.is_empty() {
        true => Ok(typed),
        false => Err(format!("dropped or changed by the API types: {}", lost.join("; "))),
    }
}

fn typed<T: DeserializeOwned + Serialize>(value: &Value, origin: &str) -> T {
    try_typed(value).unwrap_or_else(|e| panic!("{origin}: {e}"))
}

/// Collects in `lost` every place where `original` says something `back` does not.
fn kept(original: &Value, back: &Value, at: &str, lost: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(original), Value::Object(back)) => {
            for (key, value) in original {
                let here = format!("{at}.{key}");
                match back.get(key) {
                    Some(back) => kept(value, back, &here, lost),
                    None => lost.push(format!("{here} (unknown field)")),
                }
            }
        }
        (Value::Array(original), Value::Array(back)) if original.len() == back.len() => {
            for (i, (original, back)) in original.iter().zip(back).enumerate() {
                kept(original, back, &format!("{at}[{i}]"), lost);
            }
        }
        (original, back) if original == back => {}
        (original, back) => lost.push(format!("{at}: {original} came back as {back}")),
    }
}

// ---------------------------------------------------------------------------------------------
// A kustomize build, as far as these manifests need one

/// An object's identity in a build.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ObjectId {
    kind: String,
    namespace: String,
    name: String,
}

impl ObjectId {
    fn of(doc: &Value) -> Option<ObjectId> {
        Some(ObjectId {
            kind: str_at(doc, "/kind")?.to_owned(),
            namespace: str_at(doc, "/metadata/namespace").unwrap_or("default").to_owned(),
            name: str_at(doc, "/metadata/name")?.to_owned(),
        })
    }

    fn new(kind: &str, name: &str) -> ObjectId {
        ObjectId { kind: kind.into(), namespace: NAMESPACE.into(), name: name.into() }
    }
}

/// What a patch applies to.
#[derive(Debug)]
enum PatchBody {
    /// A strategic-merge patch: an object.
    StrategicMerge(Value),
    /// An RFC 6902 JSON patch: a list of operations.
    Json(Vec<Value>),
}

#[derive(Debug)]
struct Patch {
    file: PathBuf,
    target: ObjectId,
    body: PatchBody,
}

/// A kustomization, loaded and checked the way `kustomize build` would refuse it.
#[derive(Debug)]
struct Kustomization {
    dir: PathBuf,
    /// The objects of its local resource files.
    objects: Vec<Value>,
    /// The kustomizations among its resources (directories: an overlay's bases).
    nested: Vec<Kustomization>,
    /// Resources kustomize fetches at build time.
    remote: Vec<String>,
    patches: Vec<Patch>,
    /// `images`: name → the image it becomes.
    images: BTreeMap<String, String>,
}

impl Kustomization {
    fn load(dir: &Path) -> Kustomization {
        let file = dir.join("kustomization.yaml");
        let origin = shown(&file);
        let docs = file_docs(&file);
        assert_eq!(docs.len(), 1, "{origin}: one document");
        let doc = &docs[0];
        assert_eq!(str_at(doc, "/kind"), Some("Kustomization"), "{origin}: kind");
        assert!(
            str_at(doc, "/apiVersion").is_some_and(|v| v.starts_with("kustomize.config.k8s.io/")),
            "{origin}: apiVersion"
        );
        for key in doc.as_object().unwrap().keys() {
            assert!(KUSTOMIZATION_KEYS.contains(&key.as_str()), "{origin}: unknown key {key}");
        }

        let mut objects = Vec::new();
        let mut nested = Vec::new();
        let mut remote = Vec::new();
        for entry in list(doc, "/resources", &origin) {
            let entry = entry.as_str().unwrap_or_else(|| panic!("{origin}: resource {entry}"));
            if entry.contains("://") {
                assert!(entry.starts_with("https://"), "{origin}: {entry}: fetch over https");
                remote.push(entry.to_owned());
                continue;
            }
            let path = dir.join(entry);
            assert!(path.exists(), "{origin}: resource {entry} does not exist");
            if path.is_dir() {
                nested.push(Kustomization::load(&path));
            } else {
                for object in file_docs(&path) {
                    assert!(
                        ObjectId::of(&object).is_some(),
                        "{}: every document is an object with a kind and a name",
                        shown(&path)
                    );
                    objects.push(object);
                }
            }
        }

        let patches = list(doc, "/patches", &origin)
            .iter()
            .map(|entry| {
                let path = entry
                    .get("path")
                    .and_then(Value::as_str)
                    .unwrap_or_else(|| panic!("{origin}: every patch is a file: {entry}"));
                Patch::load(&dir.join(path), entry.get("target"))
            })
            .collect();

        let images = list(doc, "/images", &origin)
            .iter()
            .map(|image| {
                let name = str_at(image, "/name").unwrap_or_else(|| panic!("{origin}: {image}"));
                let new_name = str_at(image, "/newName").unwrap_or(name);
                let new = match str_at(image, "/newTag") {
                    Some(tag) => format!("{new_name}:{tag}"),
                    None => new_name.to_owned(),
                };
                (name.to_owned(), new)
            })
            .collect();

        Kustomization { dir: dir.to_path_buf(), objects, nested, remote, patches, images }
    }

    /// The remote resources of this kustomization and of those it builds on.
    fn remote_all(&self) -> Vec<&str> {
        let nested = self.nested.iter().flat_map(Kustomization::remote_all);
        self.remote.iter().map(String::as_str).chain(nested).collect()
    }

    /// The build's output: local objects, the nested kustomizations' builds, and `fetched`
    /// (standing in for the remote resources, at the level that names them), patched, with
    /// images replaced. Fails like kustomize on duplicate objects, on patches without a target
    /// and on images that name no container.
    fn build(&self, fetched: &[Value]) -> Vec<Value> {
        let origin = shown(&self.dir);
        assert_eq!(
            fetched.is_empty(),
            self.remote_all().is_empty(),
            "{origin}: the stand-ins for remote resources, exactly where there are some"
        );
        let own_fetched = if self.remote.is_empty() { &[][..] } else { fetched };
        let mut objects: Vec<Value> = self.objects.iter().chain(own_fetched).cloned().collect();
        for nested in &self.nested {
            let theirs = if nested.remote_all().is_empty() { &[][..] } else { fetched };
            objects.extend(nested.build(theirs));
        }
        let mut ids = BTreeSet::new();
        for object in &objects {
            let id = ObjectId::of(object).unwrap();
            assert!(ids.insert(id.clone()), "{origin}: {id:?} twice (kustomize refuses that)");
        }
        for patch in &self.patches {
            let object = objects
                .iter_mut()
                .find(|o| ObjectId::of(o).as_ref() == Some(&patch.target))
                .unwrap_or_else(|| {
                    panic!("{}: no {:?} in the build", shown(&patch.file), patch.target)
                });
            match &patch.body {
                PatchBody::Json(ops) => json_patch(object, ops)
                    .unwrap_or_else(|e| panic!("{}: {e}", shown(&patch.file))),
                // Merge keys and directives are kustomize's business: the tests below look
                // at the patch itself.
                PatchBody::StrategicMerge(_) => {}
            }
        }
        for (name, new) in &self.images {
            let mut replaced = 0;
            for object in &mut objects {
                for container in containers_mut(object) {
                    let Some(image) = container.get("image").and_then(Value::as_str) else {
                        continue;
                    };
                    if image == name
                        || image
                            .strip_prefix(name.as_str())
                            .is_some_and(|rest| rest.starts_with(':') || rest.starts_with('@'))
                    {
                        container["image"] = json!(new);
                        replaced += 1;
                    }
                }
            }
            for patch in &self.patches {
                if let PatchBody::StrategicMerge(body) = &patch.body {
                    replaced += containers(body)
                        .filter(|c| c.image.as_deref() == Some(name.as_str()))
                        .count();
                }
            }
            assert!(replaced > 0, "{origin}: image {name} is in no container");
        }
        objects
    }
}

impl Patch {
    fn load(file: &Path, target: Option<&Value>) -> Patch {
        let origin = shown(file);
        assert!(file.is_file(), "{origin}: the patch does not exist");
        let docs = file_docs(file);
        assert_eq!(docs.len(), 1, "{origin}: one patch a file");
        let doc = docs.into_iter().next().unwrap();
        let target = target.map(|target| {
            for key in target.as_object().unwrap().keys() {
                assert!(
                    ["group", "version", "kind", "name", "namespace"].contains(&key.as_str()),
                    "{origin}: target has {key}"
                );
            }
            ObjectId {
                kind: str_at(target, "/kind").expect("target kind").into(),
                namespace: str_at(target, "/namespace").expect("target namespace").into(),
                name: str_at(target, "/name").expect("target name").into(),
            }
        });
        match doc {
            Value::Array(ops) => {
                for op in &ops {
                    check_json_patch_op(op, &origin);
                }
                let target =
                    target.unwrap_or_else(|| panic!("{origin}: a JSON patch needs a target"));
                Patch { file: file.to_path_buf(), target, body: PatchBody::Json(ops) }
            }
            object => {
                let own = ObjectId::of(&object)
                    .unwrap_or_else(|| panic!("{origin}: a strategic merge names its object"));
                assert_eq!(target.as_ref().unwrap_or(&own), &own, "{origin}: target and object");
                Patch {
                    file: file.to_path_buf(),
                    target: own,
                    body: PatchBody::StrategicMerge(object),
                }
            }
        }
    }
}

fn list<'a>(doc: &'a Value, pointer: &str, origin: &str) -> &'a [Value] {
    match doc.pointer(pointer) {
        None => &[],
        Some(Value::Array(items)) => items,
        Some(other) => panic!("{origin}: {pointer} is not a list: {other}"),
    }
}

fn check_json_patch_op(op: &Value, origin: &str) {
    let fields = op.as_object().unwrap_or_else(|| panic!("{origin}: {op} is not an operation"));
    for key in fields.keys() {
        assert!(["op", "path", "value", "from"].contains(&key.as_str()), "{origin}: {op}: {key}");
    }
    let name = str_at(op, "/op").unwrap_or_default();
    assert!(
        ["add", "remove", "replace", "move", "copy", "test"].contains(&name),
        "{origin}: {op}: no such operation"
    );
    assert!(str_at(op, "/path").is_some_and(|p| p.starts_with('/')), "{origin}: {op}: path");
    if ["add", "replace", "test"].contains(&name) {
        assert!(fields.contains_key("value"), "{origin}: {op}: value");
    }
}

/// Applies the `test`, `add`, `replace` and `remove` operations of an RFC 6902 patch (all the
/// overlays use), all or nothing: `doc` is changed only if every operation succeeds.
fn json_patch(doc: &mut Value, ops: &[Value]) -> Result<(), String> {
    let mut patched = doc.clone();
    json_patch_in_place(&mut patched, ops)?;
    *doc = patched;
    Ok(())
}

fn json_patch_in_place(doc: &mut Value, ops: &[Value]) -> Result<(), String> {
    for op in ops {
        let path = str_at(op, "/path").unwrap();
        let value = &op["value"];
        match str_at(op, "/op").unwrap() {
            "test" => match doc.pointer(path) {
                Some(found) if found == value => {}
                found => return Err(format!("test failed: {path} is {found:?}, not {value}")),
            },
            "replace" => match doc.pointer_mut(path) {
                Some(found) => *found = value.clone(),
                None => return Err(format!("replace: nothing at {path}")),
            },
            "remove" => {
                let (parent, last) = path.rsplit_once('/').unwrap();
                let last = last.replace("~1", "/").replace("~0", "~");
                let removed = match doc.pointer_mut(parent) {
                    Some(Value::Array(items)) => match last.parse::<usize>() {
                        Ok(at) if at < items.len() => Some(items.remove(at)),
                        _ => None,
                    },
                    Some(Value::Object(fields)) => fields.remove(&last),
                    _ => None,
                };
                if removed.is_none() {
                    return Err(format!("remove: nothing at {path}"));
                }
            }
            "add" => {
                let (parent, last) = path.rsplit_once('/').unwrap();
                let last = last.replace("~1", "/").replace("~0", "~");
                match doc.pointer_mut(parent) {
                    Some(Value::Array(items)) if last == "-" => items.push(value.clone()),
                    Some(Value::Array(items)) => match last.parse::<usize>() {
                        Ok(at) if at <= items.len() => items.insert(at, value.clone()),
                        _ => return Err(format!("add: no index {last} in {parent}")),
                    },
                    Some(Value::Object(fields)) => {
                        fields.insert(last, value.clone());
                    }
                    _ => return Err(format!("add: no list or object at {parent}")),
                }
            }
            other => return Err(format!("{other}: not supported by this check")),
        }
    }
    Ok(())
}

/// The containers and init containers of a workload object.
fn containers_mut(object: &mut Value) -> Vec<&mut Value> {
    let Some(spec) = object.pointer_mut("/spec/template/spec").and_then(Value::as_object_mut)
    else {
        return Vec::new();
    };
    spec.iter_mut()
        .filter(|(key, _)| *key == "containers" || *key == "initContainers")
        .filter_map(|(_, list)| list.as_array_mut())
        .flatten()
        .collect()
}

fn containers(object: &Value) -> impl Iterator<Item = Container> + '_ {
    ["containers", "initContainers"]
        .into_iter()
        .filter_map(|key| object.pointer(&format!("/spec/template/spec/{key}")))
        .filter_map(Value::as_array)
        .flatten()
        .map(|c| serde_json::from_value::<Container>(c.clone()).unwrap())
}

fn base() -> Kustomization {
    Kustomization::load(&repo().join("manifests/base"))
}

fn agent_link_local() -> Kustomization {
    Kustomization::load(&repo().join("manifests/overlays/agent-link-local"))
}

/// upstream's node-local-dns objects, abridged.
fn stock() -> Vec<Value> {
    let docs = yaml_docs(STOCK_NODE_LOCAL_DNS, "the stock fixture");
    for doc in &docs {
        match str_at(doc, "/kind") {
            Some("DaemonSet") => {
                let _: DaemonSet = typed(doc, "the stock fixture");
            }
            Some("ConfigMap") => {
                let _: ConfigMap = typed(doc, "the stock fixture");
            }
            other => panic!("the stock fixture: {other:?}"),
        }
    }
    docs
}

/// The stock node-local-dns DaemonSet alone.
fn stock_daemonset() -> Value {
    find(&stock(), &ObjectId::new("DaemonSet", NODE_LOCAL_DNS)).clone()
}

fn find<'a>(objects: &'a [Value], id: &ObjectId) -> &'a Value {
    objects
        .iter()
        .find(|o| ObjectId::of(o).as_ref() == Some(id))
        .unwrap_or_else(|| panic!("no {id:?} in the build"))
}

fn pod_spec(daemonset: &DaemonSet) -> &PodSpec {
    daemonset.spec.as_ref().unwrap().template.spec.as_ref().expect("a pod spec")
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    spec.containers.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no container {name}"))
}

fn volume<'a>(spec: &'a PodSpec, name: &str) -> &'a Volume {
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    volumes.iter().find(|v| v.name == name).unwrap_or_else(|| panic!("no volume {name}"))
}

/// The volume mounted at `path` in `container`, and whether read-only.
fn mounted_at<'a>(spec: &'a PodSpec, container: &Container, path: &str) -> (&'a Volume, bool) {
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    let mount = mounts
        .iter()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("{}: nothing mounted at {path}", container.name));
    (volume(spec, &mount.name), mount.read_only == Some(true))
}

/// The host path and type behind a volume.
fn host_path(volume: &Volume) -> (&str, Option<&str>) {
    let host = volume.host_path.as_ref().unwrap_or_else(|| panic!("{}: hostPath", volume.name));
    (&host.path, host.type_.as_deref())
}

fn env<'a>(container: &'a Container, name: &str) -> Option<&'a str> {
    let vars = container.env.as_deref().unwrap_or_default();
    vars.iter().find(|v| v.name == name).and_then(|v| v.value.as_deref())
}

/// The value a container gives `--flag`: its args first (as clap reads them), else its env.
fn setting<'a>(container: &'a Container, flag: &str, var: &str) -> Option<&'a str> {
    let args = container.args.as_deref().unwrap_or_default();
    let from_args = args.iter().enumerate().find_map(|(i, arg)| {
        if arg == flag {
            args.get(i + 1).map(String::as_str)
        } else {
            arg.strip_prefix(flag).and_then(|rest| rest.strip_prefix('='))
        }
    });
    from_args.or_else(|| env(container, var))
}

// ---------------------------------------------------------------------------------------------
// The agent's command line

/// `nodelocaldns-ha run`'s flags by environment variable: long name and default.
fn run_flags() -> BTreeMap<String, (String, Option<String>)> {
    let mut cli = Cli::command();
    cli.build();
    let run = cli.find_subcommand("run").expect("a run subcommand");
    run.get_arguments()
        .filter_map(|arg| {
            let var = arg.get_env()?.to_str()?.to_owned();
            let long = arg.get_long()?.to_owned();
            let default = arg.get_default_values().first().and_then(|d| d.to_str()).map(Into::into);
            Some((var, (long, default)))
        })
        .collect()
}

/// node-local-dns's placeholders replaced by example values, as its installation does.
fn filled(value: &str) -> String {
    PLACEHOLDERS
        .iter()
        .fold(value.to_owned(), |v, (placeholder, example)| v.replace(placeholder, example))
}

// ---------------------------------------------------------------------------------------------
// Every document

#[test]
fn every_document_parses_into_the_type_of_its_kind_and_loses_nothing() {
    let files = yaml_files(&repo().join("manifests"));
    assert!(files.len() >= 6, "manifests/: {files:?}");
    let mut kinds = BTreeSet::new();
    for file in &files {
        if PROMETHEUS_FILES.iter().any(|f| file.ends_with(f)) {
            continue;
        }
        for (i, doc) in file_docs(file).iter().enumerate() {
            let origin = format!("{} (document {})", shown(file), i + 1);
            // The patches of node-local-dns's DaemonSet name no object (the tests below).
            if file.parent() == Some(&repo().join("manifests").join(NODE_LOCAL_DNS_PATCHES))
                && doc.is_object()
                && doc.get("kind").is_none()
            {
                node_local_dns_patch_spec(doc, &origin);
                kinds.insert("DaemonSet patch".to_owned());
                continue;
            }
            if let Value::Array(ops) = doc {
                for op in ops {
                    check_json_patch_op(op, &origin);
                }
                kinds.insert("JSON patch".to_owned());
                continue;
            }
            let kind = str_at(doc, "/kind").unwrap_or_else(|| panic!("{origin}: no kind"));
            match kind {
                "DaemonSet" => {
                    let _: DaemonSet = typed(doc, &origin);
                }
                "ServiceAccount" => {
                    let _: ServiceAccount = typed(doc, &origin);
                }
                "Service" => {
                    let _: Service = typed(doc, &origin);
                }
                // Checked key by key, with what it refers to.
                "Kustomization" => {
                    Kustomization::load(file.parent().unwrap());
                }
                "ConfigMap" => {
                    let _: ConfigMap = typed(doc, &origin);
                }
                // The webhook's (manifests/webhook; its configuration is applied to a real API
                // server by crates/webhook/tests/e2e_apiserver.rs).
                "Namespace" => {
                    let _: Namespace = typed(doc, &origin);
                }
                "Deployment" => {
                    let _: Deployment = typed(doc, &origin);
                }
                "PodDisruptionBudget" => {
                    let _: PodDisruptionBudget = typed(doc, &origin);
                }
                "MutatingWebhookConfiguration" => {
                    let _: MutatingWebhookConfiguration = typed(doc, &origin);
                }
                // manifests/examples: the DNS egress a pod's NetworkPolicy must allow.
                "NetworkPolicy" => {
                    let _: NetworkPolicy = typed(doc, &origin);
                }
                // manifests/cluster-reports: the reports' RBAC (applied to a real API server
                // and checked with `kubectl auth can-i` by tests/e2e_cluster.rs).
                "ClusterRole" => {
                    let _: ClusterRole = typed(doc, &origin);
                }
                "ClusterRoleBinding" => {
                    let _: ClusterRoleBinding = typed(doc, &origin);
                }
                "Role" => {
                    let _: Role = typed(doc, &origin);
                }
                "RoleBinding" => {
                    let _: RoleBinding = typed(doc, &origin);
                }
                // manifests/cluster-reports: the agent held to its own Node (applied to a real
                // API server and tried with the agent's token by tests/e2e_cluster.rs).
                "ValidatingAdmissionPolicy" => {
                    let _: ValidatingAdmissionPolicy = typed(doc, &origin);
                }
                "ValidatingAdmissionPolicyBinding" => {
                    let _: ValidatingAdmissionPolicyBinding = typed(doc, &origin);
                }
                // cert-manager's kinds: no API types here.
                "Issuer" | "Certificate" => {
                    assert_eq!(str_at(doc, "/apiVersion"), Some("cert-manager.io/v1"), "{origin}");
                }
                // Checked against the DaemonSets they select (below).
                "PodMonitor" => {
                    assert_eq!(str_at(doc, "/apiVersion"), Some("monitoring.coreos.com/v1"));
                    assert_eq!(str_at(doc, "/metadata/namespace"), Some(NAMESPACE), "{origin}");
                }
                // Its spec is the rules file's (tests/alerts.rs).
                "PrometheusRule" => {
                    assert_eq!(str_at(doc, "/apiVersion"), Some("monitoring.coreos.com/v1"));
                    assert_eq!(str_at(doc, "/metadata/name"), Some(AGENT), "{origin}");
                    assert_eq!(str_at(doc, "/metadata/namespace"), Some(NAMESPACE), "{origin}");
                }
                "Component" => {
                    let api = str_at(doc, "/apiVersion");
                    assert_eq!(api, Some("kustomize.config.k8s.io/v1alpha1"), "{origin}");
                    for resource in list(doc, "/resources", &origin) {
                        let resource = resource.as_str().expect("a resource path");
                        let path = file.parent().unwrap().join(resource);
                        assert!(!file_docs(&path).is_empty(), "{origin}: {resource}");
                    }
                }
                other => panic!("{origin}: kind {other} is not expected here"),
            }
            kinds.insert(kind.to_owned());
        }
    }
    let expected = [
        "Certificate",
        "ClusterRole",
        "ClusterRoleBinding",
        "Component",
        "ConfigMap",
        "DaemonSet",
        "DaemonSet patch",
        "Deployment",
        "Issuer",
        "JSON patch",
        "Kustomization",
        "MutatingWebhookConfiguration",
        "Namespace",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PodMonitor",
        "PrometheusRule",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    assert_eq!(kinds, expected.iter().map(|k| k.to_string()).collect());
}

#[test]
fn the_round_trip_catches_a_misspelt_field() {
    let doc = yaml_docs(
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {}\n  \
         template:\n    spec:\n      containers: [{name: a, livenesProbe: {}}]\n",
        "inline",
    );
    let message = try_typed::<DaemonSet>(&doc[0]).unwrap_err();
    assert!(message.contains(".spec.template.spec.containers[0].livenesProbe"), "{message}");
}

// ---------------------------------------------------------------------------------------------
// The kustomizations

#[test]
fn every_kustomization_is_one_these_tests_check() {
    let root = repo().join("manifests");
    let found: BTreeSet<String> = yaml_files(&root)
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n == "kustomization.yaml"))
        .map(|f| f.parent().unwrap().strip_prefix(&root).unwrap().display().to_string())
        .collect();
    let known: BTreeSet<String> =
        KUSTOMIZATIONS.iter().chain(&COMPONENTS).map(|k| k.to_string()).collect();
    assert_eq!(found, known, "a kustomization these tests do not know of, or one gone");
}

/// The agent and its ServiceAccount, nothing of node-local-dns's: its upstream Service above
/// all, whose ClusterIP every running node-cache read once, at its start (a base that carried it
/// would delete it with `kubectl delete -k` or a GitOps prune).
#[test]
fn the_base_builds_into_the_agent_and_its_service_account_alone() {
    let base = base();
    assert!(base.remote.is_empty(), "the base is self-contained");
    let ids: BTreeSet<ObjectId> =
        base.build(&[]).iter().map(|o| ObjectId::of(o).unwrap()).collect();
    let expected =
        BTreeSet::from([ObjectId::new("DaemonSet", AGENT), ObjectId::new("ServiceAccount", AGENT)]);
    assert_eq!(ids, expected);
}

#[test]
fn the_base_sets_the_image_the_drain_patch_names() {
    let base = base();
    assert_eq!(base.images.keys().collect::<Vec<_>>(), [IMAGE]);
    // The link-local overlay takes the image from the base: setting it there sets it for both.
    assert!(agent_link_local().images.is_empty(), "the link-local overlay: images of its own");
    // The drain patch's client is the agent's build: the same name, on a line of its own for
    // the `sed` that fills it (the install's NOTES, manifests/README.md).
    let text = read(&node_local_dns_patch_file("drain.yaml"));
    let lines: Vec<&str> =
        text.lines().filter(|l| l.ends_with(&format!("image: {IMAGE}"))).collect();
    assert_eq!(lines.len(), 1, "one `image: {IMAGE}` line: {lines:?}");
}

// ---------------------------------------------------------------------------------------------
// The agent's DaemonSet

fn agent_daemonset() -> DaemonSet {
    let objects = base().build(&[]);
    typed(find(&objects, &ObjectId::new("DaemonSet", AGENT)), "the agent's DaemonSet")
}

#[test]
fn the_agent_runs_on_every_node_in_the_host_network_as_critical() {
    let ds = agent_daemonset();
    let spec = pod_spec(&ds);
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(spec.dns_policy.as_deref(), Some("Default"), "never the cluster DNS it rescues");
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    assert!(
        tolerations.iter().any(|t| t.operator.as_deref() == Some("Exists")
            && t.key.is_none()
            && t.effect.is_none()),
        "tolerates every taint: {tolerations:?}"
    );
    assert_eq!(spec.service_account_name.as_deref(), Some(AGENT));
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(spec.containers.len(), 1);
}

#[test]
fn the_agent_asks_for_its_capabilities_and_nothing_more() {
    let ds = agent_daemonset();
    let spec = pod_spec(&ds);
    assert!(spec.host_pid != Some(true) && spec.host_ipc != Some(true));
    for container in spec.containers.iter().chain(spec.init_containers.iter().flatten()) {
        let sc = container.security_context.as_ref().expect("a securityContext");
        assert_ne!(sc.privileged, Some(true), "{}: not privileged", container.name);
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", container.name);
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", container.name);
        let caps = sc.capabilities.as_ref().expect("capabilities");
        assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]), "{}", container.name);
        let added = caps.add.as_deref().unwrap_or_default();
        assert!(added.iter().any(|c| c == "NET_ADMIN"), "{}: NET_ADMIN", container.name);
        for cap in added {
            assert!(CAPABILITIES.contains(&cap.as_str()), "{}: {cap}", container.name);
        }
    }
}

#[test]
fn the_agent_requests_what_it_uses_and_has_no_cpu_limit() {
    let ds = agent_daemonset();
    let resources = container(pod_spec(&ds), "agent").resources.clone().expect("resources");
    let (requests, limits) = (resources.requests.unwrap_or_default(), resources.limits);
    let quantity = |map: &BTreeMap<String, Quantity>, key: &str| map.get(key).map(|q| q.0.clone());
    assert_eq!(quantity(&requests, "cpu").as_deref(), Some("10m"));
    assert_eq!(quantity(&requests, "memory").as_deref(), Some("16Mi"));
    let limits = limits.unwrap_or_default();
    assert_eq!(quantity(&limits, "memory").as_deref(), Some("64Mi"));
    assert!(!limits.contains_key("cpu"), "CPU throttling would become probe timeouts");
}

#[test]
fn the_agent_settings_are_flags_it_accepts() {
    let ds = agent_daemonset();
    let spec = pod_spec(&ds);
    let agent = container(spec, "agent");
    let flags = run_flags();
    let mut argv = vec![AGENT.to_owned()];
    argv.extend(agent.args.iter().flatten().cloned());
    assert_eq!(argv.get(1).map(String::as_str), Some("run"));
    for var in agent.env.iter().flatten() {
        if !var.name.starts_with("NODELOCALDNS_HA_") {
            continue;
        }
        let (long, _) = flags
            .get(&var.name)
            .unwrap_or_else(|| panic!("{}: no flag of `run` reads it", var.name));
        let value = var.value.as_deref().unwrap_or_else(|| panic!("{}: a value", var.name));
        argv.extend([format!("--{long}"), filled(value)]);
    }
    if let Err(e) = Cli::command().try_get_matches_from(&argv) {
        panic!("`{}` is refused:\n{e}", argv.join(" "));
    }
    assert_eq!(env(agent, "NODELOCALDNS_HA_LOCAL_IP"), Some("__PILLAR__LOCAL__DNS__"));
    assert_eq!(env(agent, "NODELOCALDNS_HA_CLUSTER_DNS_IP"), Some("__PILLAR__DNS__SERVER__"));

    // The upstream comes from node-local-dns's upstream Service's variables (upstream's
    // manifest's kube-dns-upstream), named explicitly; the reports' Role, which lets the agent
    // follow it, names the same one.
    assert_eq!(spec.enable_service_links, Some(true));
    let upstream_svc = setting(agent, "--upstream-svc", "NODELOCALDNS_HA_UPSTREAM_SVC");
    assert_eq!(upstream_svc, flags["NODELOCALDNS_HA_UPSTREAM_SVC"].1.as_deref());
    assert_eq!(upstream_svc, Some("kube-dns-upstream"));
    assert!(setting(agent, "--upstream-ip", "NODELOCALDNS_HA_UPSTREAM_IP").is_none());
    let rbac = file_docs(&repo().join("manifests/cluster-reports/rbac.yaml"));
    let role =
        rbac.iter().find(|o| str_at(o, "/metadata/name") == Some("nodelocaldns-ha-upstream"));
    let role: Role = typed(role.expect("the upstream Service's Role"), "cluster-reports/rbac.yaml");
    let names = role.rules.unwrap_or_default().remove(0).resource_names;
    assert_eq!(names, Some(vec![upstream_svc.unwrap().to_owned()]));
}

#[test]
fn the_service_account_carries_no_token() {
    let objects = base().build(&[]);
    let account: ServiceAccount =
        typed(find(&objects, &ObjectId::new("ServiceAccount", AGENT)), "the service account");
    assert_eq!(account.automount_service_account_token, Some(false));
    let everything = base().objects;
    assert!(
        everything.iter().all(|o| !str_at(o, "/kind").unwrap().contains("Role")),
        "the agent needs no API rights"
    );
}

/// A node address for `$(HOST_IP)`, which the kubelet fills from `status.hostIP`.
const NODE_IP: &str = "10.0.0.7";

/// The metrics address the agent is given, explicitly, with `$(HOST_IP)` (which must come from
/// the downward API's `status.hostIP`, defined before it) as [`NODE_IP`], parsed as the agent
/// parses it.
fn metrics_addr(agent: &Container) -> SocketAddr {
    let addr = setting(agent, "--metrics-addr", "NODELOCALDNS_HA_METRICS_ADDR")
        .expect("the manifest sets the metrics address that its probes rely on");
    if addr.contains("$(HOST_IP)") {
        let vars = agent.env.as_deref().unwrap_or_default();
        let host_ip = vars.iter().position(|v| v.name == "HOST_IP").expect("HOST_IP defined");
        let metrics = vars.iter().position(|v| v.name == "NODELOCALDNS_HA_METRICS_ADDR").unwrap();
        assert!(host_ip < metrics, "HOST_IP is defined after the address that uses it");
        let field = vars[host_ip].value_from.as_ref().and_then(|f| f.field_ref.as_ref());
        assert_eq!(field.map(|f| f.field_path.as_str()), Some("status.hostIP"));
    }
    let addr = addr.replace("$(HOST_IP)", NODE_IP);
    // `[IPv4]:PORT` as Go writes it, which the agent takes too.
    let bare = addr.strip_prefix('[').and_then(|a| a.split_once("]:"));
    let bare = bare.map(|(ip, port)| format!("{ip}:{port}"));
    let text = bare.filter(|b| b.parse::<SocketAddr>().is_ok()).unwrap_or(addr.clone());
    text.parse().unwrap_or_else(|e| panic!("metrics address {addr:?}: {e}"))
}

/// Checks that `probe` is an HTTP GET of `path` that reaches `addr` from the kubelet.
fn check_probe(
    which: &str,
    probe: Option<&Probe>,
    agent: &Container,
    addr: SocketAddr,
    path: &str,
) {
    let get = probe
        .and_then(|p| p.http_get.as_ref())
        .unwrap_or_else(|| panic!("{which}: an httpGet probe"));
    assert_eq!(get.path.as_deref(), Some(path), "{which}");
    assert!(matches!(get.scheme.as_deref(), None | Some("HTTP")), "{which}: plain HTTP");
    let port = match &get.port {
        IntOrString::Int(port) => *port,
        IntOrString::String(name) => {
            let ports = agent.ports.as_deref().unwrap_or_default();
            ports.iter().find(|p| p.name.as_deref() == Some(name.as_str())).unwrap().container_port
        }
    };
    assert_eq!(port, i32::from(addr.port()), "{which}: the metrics port");
    // The kubelet probes the pod IP, the node IP with hostNetwork, unless `host` says otherwise:
    // an agent bound to another address is reached only with `host` set to it.
    if addr.ip().to_string() == NODE_IP {
        assert_eq!(get.host, None, "{which}: the pod IP is the node's address");
    } else if !addr.ip().is_unspecified() {
        assert_eq!(get.host.as_deref(), Some(addr.ip().to_string().as_str()), "{which}: host");
    }
}

#[test]
fn the_probes_reach_the_metrics_address() {
    let ds = agent_daemonset();
    let agent = container(pod_spec(&ds), "agent");
    let addr = metrics_addr(agent);
    // The node's own address (issue 19), where the cluster's Prometheus scrapes it; never the
    // wildcard, which would answer on the node-local IPs too.
    assert_eq!(addr, SocketAddr::new(NODE_IP.parse().unwrap(), 9254), "the node's address");
    let metrics = agent.ports.iter().flatten().find(|p| p.name.as_deref() == Some("metrics"));
    assert_eq!(metrics.map(|p| p.container_port), Some(9254), "a port named metrics");
    check_probe("liveness", agent.liveness_probe.as_ref(), agent, addr, "/healthz");
    check_probe("readiness", agent.readiness_probe.as_ref(), agent, addr, "/readyz");
}

#[test]
fn the_state_dir_and_the_xtables_lock_are_the_hosts() {
    let ds = agent_daemonset();
    let spec = pod_spec(&ds);
    let agent = container(spec, "agent");
    let state_dir = setting(agent, "--state-dir", "NODELOCALDNS_HA_STATE_DIR").unwrap_or(STATE_DIR);
    assert_eq!(state_dir, STATE_DIR, "where `status` and `drain` look by default");
    let (state, read_only) = mounted_at(spec, agent, state_dir);
    assert!(!read_only);
    assert_eq!(host_path(state), (STATE_DIR, Some("DirectoryOrCreate")));
    let (lock, read_only) = mounted_at(spec, agent, XTABLES_LOCK);
    assert!(!read_only);
    let (path, kind) = host_path(lock);
    assert_eq!(path, XTABLES_LOCK);
    assert!(matches!(kind, Some("File" | "FileOrCreate")), "a file, not a directory: {kind:?}");
}

// ---------------------------------------------------------------------------------------------
// The patches of node-local-dns's DaemonSet

/// A file of manifests/node-local-dns.
fn node_local_dns_patch_file(name: &str) -> PathBuf {
    repo().join("manifests").join(NODE_LOCAL_DNS_PATCHES).join(name)
}

/// `value` without strategic-merge directives: list items that carry `$patch`, and nulls (a
/// field deleted).
fn without_directives(value: &Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(
            items.iter().filter(|i| i.get("$patch").is_none()).map(without_directives).collect(),
        ),
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_directives(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A strategic-merge patch of node-local-dns's DaemonSet, its pod spec typed (directives left
/// out). It says nothing but the spec: no kind, no name, so that `kubectl patch` takes it for a
/// DaemonSet of any name (kubespray's nodelocaldns; a name in the patch would be refused there).
fn node_local_dns_patch_spec(doc: &Value, origin: &str) -> PodSpec {
    let keys: Vec<&str> = doc.as_object().expect("an object").keys().map(String::as_str).collect();
    assert_eq!(keys, ["spec"], "{origin}: the spec alone: no kind, no name");
    let spec = doc.pointer("/spec/template/spec").unwrap_or_else(|| panic!("{origin}: a pod spec"));
    typed(&without_directives(spec), origin)
}

/// The drain patch's pod spec (drain.yaml).
fn drain_patch() -> PodSpec {
    let file = node_local_dns_patch_file("drain.yaml");
    node_local_dns_patch_spec(&file_docs(&file)[0], &shown(&file))
}

/// The args patch (args.yaml): its operations.
fn args_patch() -> Vec<Value> {
    let file = node_local_dns_patch_file("args.yaml");
    match file_docs(&file).remove(0) {
        Value::Array(ops) => ops,
        other => panic!("{}: a JSON patch, not {other}", shown(&file)),
    }
}

/// node-local-dns's DaemonSet as each flavour deploys it: upstream's (abridged), deliveryhero's
/// and kubespray's (tests/e2e_deploy.rs's, testdata/node-local-dns).
fn flavour_daemonsets() -> Vec<(&'static str, Value)> {
    let mut found = vec![("upstream", stock_daemonset())];
    for flavour in ["deliveryhero", "kubespray"] {
        let file = repo().join(format!("testdata/node-local-dns/{flavour}.yaml"));
        let docs = file_docs(&file);
        let ds = docs.into_iter().find(|d| str_at(d, "/kind") == Some("DaemonSet"));
        found.push((flavour, ds.expect("a DaemonSet")));
    }
    found
}

/// node-cache's args in a DaemonSet.
fn node_cache_args(daemonset: &Value) -> Vec<String> {
    let ds: DaemonSet = typed(daemonset, "node-local-dns");
    container(pod_spec(&ds), NODE_CACHE).args.clone().unwrap_or_default()
}

/// The value node-cache takes for boolean flag `name`: Go's flag package keeps the last one
/// given (`-name` alone is true).
fn go_bool_flag(args: &[String], name: &str) -> Option<bool> {
    args.iter().rev().find_map(|arg| {
        let arg = arg.trim_start_matches('-');
        match arg.strip_prefix(name)? {
            "" => Some(true),
            rest => rest.strip_prefix('=').map(|v| v == "true"),
        }
    })
}

#[test]
fn node_cache_leaves_the_rules_to_the_agent_on_every_flavour() {
    for (flavour, mut ds) in flavour_daemonsets() {
        let before = node_cache_args(&ds);
        json_patch(&mut ds, &args_patch()).unwrap_or_else(|e| panic!("{flavour}: {e}"));
        let after = node_cache_args(&ds);
        assert_eq!(after[..before.len()], before[..], "{flavour}: node-cache's own args are kept");
        let added: Vec<&str> = after[before.len()..].iter().map(String::as_str).collect();
        assert_eq!(added, ["-setupiptables=false", "-skipteardown"], "{flavour}");
        // Whatever the flavour passed before (deliveryhero: -setupiptables=true,
        // -skipteardown=false), node-cache takes these.
        assert_eq!(go_bool_flag(&after, "setupiptables"), Some(false), "{flavour}: {after:?}");
        assert_eq!(go_bool_flag(&after, "skipteardown"), Some(true), "{flavour}: {after:?}");
    }
}

#[test]
fn the_args_patch_refuses_a_daemonset_it_was_not_written_for() {
    let mut sidecar_first = stock_daemonset();
    let containers = sidecar_first.pointer_mut("/spec/template/spec/containers").unwrap();
    containers.as_array_mut().unwrap().insert(0, json!({"name": "sidecar", "args": ["-x"]}));
    let before = sidecar_first.clone();
    assert!(json_patch(&mut sidecar_first, &args_patch()).is_err(), "another container first");
    assert_eq!(sidecar_first, before, "changed anyway");
}

#[test]
fn node_cache_drains_through_the_agent_before_it_stops() {
    let spec = drain_patch();
    let spec = &spec;
    let node_cache = container(spec, NODE_CACHE);
    let command = node_cache
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|h| h.exec.as_ref())
        .and_then(|e| e.command.clone())
        .expect("an exec preStop hook");

    // `… nodelocaldns-ha drain [flags]`, as the agent's command line takes it.
    let at = command.iter().position(|w| w == "drain").expect("runs drain");
    let binary = &command[at - 1];
    assert!(binary.ends_with("/nodelocaldns-ha"), "{command:?}");
    let argv: Vec<&str> =
        [AGENT].into_iter().chain(command[at..].iter().map(String::as_str)).collect();
    let matches = Cli::command()
        .try_get_matches_from(&argv)
        .unwrap_or_else(|e| panic!("`{}` is refused:\n{e}", argv.join(" ")));
    let drain = matches.subcommand_matches("drain").unwrap();
    let timeout = drain.get_one::<String>("timeout").expect("a drain timeout");
    let timeout = parse_duration(timeout).expect("a duration");

    // The grace period holds the longest drain and node-cache's own shutdown (kubespray's 0
    // would leave no time for the hook at all).
    let grace = Duration::from_secs(spec.termination_grace_period_seconds.expect("set") as u64);
    assert!(
        grace >= timeout + DRAIN_CALL_SLACK + NODE_CACHE_SHUTDOWN,
        "terminationGracePeriodSeconds {grace:?} for a drain of up to {:?}",
        timeout + DRAIN_CALL_SLACK
    );

    // Everything the hook runs comes from one emptyDir, filled by an init container from the
    // agent's image before node-cache starts.
    let dir = Path::new(binary).parent().unwrap().to_str().unwrap();
    assert!(Path::new(&command[0]).starts_with(dir), "{command:?}: all from {dir}");
    let (client, _) = mounted_at(spec, node_cache, dir);
    assert!(client.empty_dir.is_some(), "{}: an emptyDir", client.name);
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let copier = init
        .iter()
        .find(|c| {
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == client.name && m.read_only != Some(true))
        })
        .expect("an init container fills the client volume");
    assert_eq!(copier.image.as_deref(), Some(IMAGE), "the agent's image (the NOTES' sed)");
    let mut copies = copier.command.iter().chain(copier.args.iter()).flatten();
    assert!(copies.any(|w| w.starts_with(CLIENT_BUNDLE)), "copies {CLIENT_BUNDLE}");
    let sc = copier.security_context.as_ref().expect("a securityContext");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let drops = sc.capabilities.as_ref().and_then(|c| c.drop.clone()).unwrap_or_default();
    assert_eq!(drops, ["ALL"], "copying files needs no capability");

    // `drain` finds the agent's control socket where the agent's state dir is on the host.
    let state_dir = drain.get_one::<std::path::PathBuf>("state_dir").expect("a state dir");
    assert_eq!(state_dir, Path::new(STATE_DIR));
    let (state, _) = mounted_at(spec, node_cache, STATE_DIR);
    assert_eq!(host_path(state).0, STATE_DIR);
}

/// The bundle itself, in the image that was built, is checked by tests/e2e_image.rs.
#[test]
fn the_drain_client_comes_from_the_dockerfile_bundle() {
    let rootfs = read(&repo().join("ci/image/rootfs.sh"));
    assert!(rootfs.contains(&format!("bundle=$root{CLIENT_BUNDLE}")), "the image has the bundle");
    assert!(rootfs.contains(r#""$bundle/ld.so""#), "the bundle has its ld.so");
    let dockerfile = Dockerfile::load();
    let assembled =
        dockerfile.stages[0].iter().any(|(k, rest)| k == "RUN" && rest.contains("rootfs.sh"));
    assert!(assembled, "the build stage runs ci/image/rootfs.sh");
    let spec = drain_patch();
    let node_cache = container(&spec, NODE_CACHE);
    let command = node_cache.lifecycle.as_ref().unwrap().pre_stop.as_ref().unwrap();
    let command = command.exec.as_ref().unwrap().command.clone().unwrap();
    // The bundle's loader runs the binary, with the bundle's libraries.
    let loader = Path::new(&command[0]);
    assert_eq!(loader.file_name().unwrap(), "ld.so");
    let dir = loader.parent().unwrap().to_str().unwrap();
    assert_eq!(command[1..3], ["--library-path", dir]);
}

/// remove-drain.yaml deletes exactly what drain.yaml adds: its init container, node-cache's
/// preStop hook and mounts, its volumes (tests/e2e_deploy.rs applies both to a real API server).
#[test]
fn the_drains_removal_deletes_what_the_drain_adds() {
    let file = node_local_dns_patch_file("remove-drain.yaml");
    let removal = file_docs(&file).remove(0);
    node_local_dns_patch_spec(&removal, &shown(&file));
    let spec = &removal["spec"]["template"]["spec"];
    let deleted = |list: &Value, key: &str| -> BTreeSet<String> {
        let items = list.as_array().map(Vec::as_slice).unwrap_or_default();
        assert!(items.iter().all(|i| i["$patch"] == "delete"), "{items:?}");
        items.iter().map(|i| i[key].as_str().expect(key).to_owned()).collect()
    };
    let added = drain_patch();
    let names = |names: &mut dyn Iterator<Item = &String>| names.cloned().collect::<BTreeSet<_>>();
    let init = added.init_containers.as_deref().unwrap_or_default();
    assert_eq!(deleted(&spec["initContainers"], "name"), names(&mut init.iter().map(|c| &c.name)));
    let volumes = added.volumes.as_deref().unwrap_or_default();
    assert_eq!(deleted(&spec["volumes"], "name"), names(&mut volumes.iter().map(|v| &v.name)));
    let node_cache = &spec["containers"][0];
    assert_eq!(node_cache["name"], NODE_CACHE);
    let mounts = container(&added, NODE_CACHE).volume_mounts.as_deref().unwrap_or_default();
    let paths = names(&mut mounts.iter().map(|m| &m.mount_path));
    assert_eq!(deleted(&node_cache["volumeMounts"], "mountPath"), paths);
    assert_eq!(node_cache["lifecycle"], json!({"preStop": null}), "the hook, and no more");
}

// ---------------------------------------------------------------------------------------------
// The link-local shape: pods query the link-local IP itself

/// The `s/FROM/TO/g` expressions of the `sed -e "…"` in `text`, with `$VAR`s of `vars` put in
/// (any other variable fails: the link-local fill has no ClusterIP to give).
fn sed_fills(text: &str, vars: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut fills = Vec::new();
    for expression in text.split("-e \"").skip(1) {
        let expression = &expression[..expression.find('"').expect("a closing quote")];
        let parts: Vec<&str> = expression.split('/').collect();
        assert!(
            parts.len() == 4 && parts[0] == "s" && parts[3] == "g",
            "{expression}: not s/FROM/TO/g"
        );
        let mut to = parts[2].to_owned();
        for (var, value) in vars {
            to = to.replace(&format!("${var}"), value);
        }
        assert!(!to.contains('$'), "{expression}: a variable this fill does not have");
        fills.push((parts[1].to_owned(), to));
    }
    assert!(!fills.is_empty(), "no sed expressions in:\n{text}");
    fills
}

/// The comment lines at the top of a kustomization, `#` stripped.
fn leading_comment(path: &Path) -> String {
    let text = read(path);
    let lines = text.lines().take_while(|l| l.starts_with('#'));
    lines.map(|l| l.trim_start_matches('#')).collect::<Vec<_>>().join("\n")
}

/// Every documented fill for the link-local shape, by where it is written: the link-local
/// overlay's comment, and the `sh` blocks of manifests/README.md's section on the shape that
/// fill placeholders (run with `$LOCAL_DNS` the link-local IP).
fn link_local_fills() -> Vec<(String, Vec<(String, String)>)> {
    let mut fills = Vec::new();
    let file = agent_link_local().dir.join("kustomization.yaml");
    fills.push((shown(&file), sed_fills(&leading_comment(&file), &[])));
    let readme = read(&repo().join("manifests/README.md"));
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("The link-local shape"))
        .expect("manifests/README.md has a section on the link-local shape");
    let vars = [("LOCAL_DNS", LINK_LOCAL_IP), ("DOMAIN", "cluster.local")];
    for (i, block) in section.split("```sh").skip(1).enumerate() {
        let block = &block[..block.find("```").expect("the block ends")];
        if !block.contains("__PILLAR__") {
            continue;
        }
        let origin = format!("manifests/README.md, the link-local shape's block {}", i + 1);
        fills.push((origin, sed_fills(block, &vars)));
    }
    assert!(fills.len() >= 2, "the overlay's and the README's: {fills:?}");
    fills
}

/// `objects` with `fills` done in every string, as `sed` does them in `kubectl kustomize`'s
/// output (the placeholders sit inside string values, the Corefile's lines included).
fn filled_with(objects: &[Value], fills: &[(String, String)]) -> Vec<Value> {
    fn fill(value: &mut Value, fills: &[(String, String)]) {
        match value {
            Value::String(text) => {
                for (from, to) in fills {
                    *text = text.replace(from.as_str(), to);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| fill(v, fills)),
            Value::Object(fields) => fields.values_mut().for_each(|v| fill(v, fills)),
            _ => {}
        }
    }
    let mut objects = objects.to_vec();
    objects.iter_mut().for_each(|o| fill(o, fills));
    objects
}

/// Every `__PILLAR__…__` placeholder in `objects` that node-cache does not fill itself.
fn unfilled(objects: &[Value]) -> BTreeSet<String> {
    let text = serde_json::to_string(objects).unwrap();
    let mut left = BTreeSet::new();
    for (at, _) in text.match_indices("__PILLAR__") {
        let rest = &text[at + "__PILLAR__".len()..];
        let end = rest.find(|c: char| !(c.is_ascii_uppercase() || c == '_')).unwrap_or(rest.len());
        let placeholder = format!("__PILLAR__{}", &rest[..end]);
        if !NODE_CACHE_FILLS.contains(&placeholder.as_str()) {
            left.insert(placeholder);
        }
    }
    left
}

/// The agent's settings, validated as `nodelocaldns-ha run` validates them, with the
/// kube-dns-upstream Service's variable as the kubelet gives it.
fn agent_config(agent: &Container) -> Result<nodelocaldns_ha::config::AgentConfig, String> {
    let mut argv = vec![AGENT.to_owned()];
    argv.extend(agent.args.iter().flatten().cloned());
    let flags = run_flags();
    // As the kubelet sets them: `status.hostIP` is the node's address ([`NODE_IP`]), and
    // `$(NAME)` in a value is an earlier variable's.
    let mut set: Vec<(String, String)> = Vec::new();
    for var in agent.env.iter().flatten() {
        let field = var.value_from.as_ref().and_then(|f| f.field_ref.as_ref());
        let mut value = match field.map(|f| f.field_path.as_str()) {
            Some("status.hostIP") => NODE_IP.to_owned(),
            _ => var.value.clone().unwrap_or_default(),
        };
        for (name, earlier) in &set {
            value = value.replace(&format!("$({name})"), earlier);
        }
        if var.name.starts_with("NODELOCALDNS_HA_") {
            let (long, _) = &flags[&var.name];
            argv.extend([format!("--{long}"), value.clone()]);
        }
        set.push((var.name.clone(), value));
    }
    let cli = Cli::try_parse_from(&argv).map_err(|e| format!("`{}`: {e}", argv.join(" ")))?;
    let nodelocaldns_ha::cli::Command::Run(run) = cli.command else {
        return Err(format!("`{}`: not `run`", argv.join(" ")));
    };
    let env = |var: &str| (var == "KUBE_DNS_UPSTREAM_SERVICE_HOST").then(|| "10.96.0.11".into());
    nodelocaldns_ha::config::AgentConfig::from_args(&run.raw(), env).map_err(|e| e.to_string())
}

#[test]
fn the_link_local_agent_is_the_base_without_the_cluster_dns_ip() {
    let overlay = agent_link_local();
    assert!(overlay.objects.is_empty() && overlay.remote_all().is_empty(), "only the base");
    let bases: Vec<PathBuf> =
        overlay.nested.iter().map(|k| k.dir.canonicalize().unwrap()).collect();
    assert_eq!(bases, [base().dir.canonicalize().unwrap()], "builds on the base");
    for patch in &overlay.patches {
        assert_eq!(patch.target, ObjectId::new("DaemonSet", AGENT), "{:?}", patch.file);
    }

    // Object by object the base's, but for the one variable.
    let (ours, theirs) = (overlay.build(&[]), base().build(&[]));
    assert_eq!(ours.len(), theirs.len());
    for object in &theirs {
        let id = ObjectId::of(object).unwrap();
        let mut expected = object.clone();
        if id == ObjectId::new("DaemonSet", AGENT) {
            let env = expected.pointer_mut("/spec/template/spec/containers/0/env").unwrap();
            let env = env.as_array_mut().unwrap();
            let before = env.len();
            env.retain(|v| v["name"] != "NODELOCALDNS_HA_CLUSTER_DNS_IP");
            assert_eq!(env.len(), before - 1, "the base sets NODELOCALDNS_HA_CLUSTER_DNS_IP");
        }
        assert_eq!(find(&ours, &id), &expected, "{id:?}");
    }
    let ds: DaemonSet = typed(find(&ours, &ObjectId::new("DaemonSet", AGENT)), "built");
    let agent = container(pod_spec(&ds), "agent");
    assert_eq!(env(agent, "NODELOCALDNS_HA_LOCAL_IP"), Some("__PILLAR__LOCAL__DNS__"));
    assert_eq!(setting(agent, "--cluster-dns-ip", "NODELOCALDNS_HA_CLUSTER_DNS_IP"), None);
}

#[test]
fn the_link_local_agent_runs_in_the_link_local_shape() {
    let objects = agent_link_local().build(&[]);
    for (origin, fills) in link_local_fills() {
        let built = filled_with(&objects, &fills);
        assert_eq!(unfilled(&built), BTreeSet::new(), "{origin}: every placeholder filled");
        let ds: DaemonSet = typed(find(&built, &ObjectId::new("DaemonSet", AGENT)), "filled");
        let config = agent_config(container(pod_spec(&ds), "agent"))
            .unwrap_or_else(|e| panic!("{origin}: {e}"));
        let local: std::net::IpAddr = LINK_LOCAL_IP.parse().unwrap();
        assert_eq!(config.addrs.local, [local], "{origin}");
        assert!(config.addrs.cluster_dns.is_empty(), "{origin}: {:?}", config.addrs.cluster_dns);
        assert!(config.shape.link_local, "{origin}: the link-local IP fails over");
    }

    // The same check reads the ClusterIP shape in the base.
    let base = filled_with(&base().build(&[]), &PLACEHOLDERS.map(|(p, v)| (p.into(), v.into())));
    let ds: DaemonSet = typed(find(&base, &ObjectId::new("DaemonSet", AGENT)), "base");
    let config = agent_config(container(pod_spec(&ds), "agent")).unwrap();
    assert_eq!(config.addrs.cluster_dns, ["10.96.0.10".parse::<std::net::IpAddr>().unwrap()]);
}

#[test]
fn the_link_local_patch_refuses_a_base_it_was_not_written_for() {
    let agent_env = match &agent_link_local().patches[..] {
        [Patch { body: PatchBody::Json(ops), .. }] => ops.clone(),
        other => panic!("the link-local overlay: one JSON patch, not {other:?}"),
    };
    let base = find(&base().build(&[]), &ObjectId::new("DaemonSet", AGENT)).clone();
    assert!(json_patch(&mut base.clone(), &agent_env).is_ok(), "the base patches");
    let mut reordered = base.clone();
    reordered["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap()
        .swap(1, 2);
    let mut renamed = base.clone();
    renamed["spec"]["template"]["spec"]["containers"][0]["name"] = json!("nodelocaldns-ha");
    for (what, mut ds) in [("variables reordered", reordered), ("container renamed", renamed)] {
        let before = ds.clone();
        assert!(json_patch(&mut ds, &agent_env).is_err(), "the agent, {what}: patched");
        assert_eq!(ds, before, "the agent, {what}: changed anyway");
    }
}

// ---------------------------------------------------------------------------------------------
// A real kustomize, where there is one

/// Whether kubectl is on PATH (its built-in kustomize, its offline `patch --local`).
fn has_kubectl() -> bool {
    Command::new("kubectl").args(["version", "--client"]).output().is_ok()
}

/// `kubectl kustomize DIR`.
fn kubectl_kustomize(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl").arg("kustomize").arg(dir).output().expect("kubectl");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_docs(&String::from_utf8(out.stdout).unwrap(), "kubectl kustomize")
}

/// `kubectl patch --local` of `object` with `patch` (a file's text) of `kind` (strategic, json),
/// as `kubectl patch` on a cluster would change it.
fn kubectl_patch_local(object: &Value, kind: &str, patch: &str) -> Value {
    let dir = std::env::temp_dir().join(format!("nodelocaldns-ha-patch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (file, patch_file) = (dir.join("object.json"), dir.join("patch.yaml"));
    std::fs::write(&file, object.to_string()).unwrap();
    std::fs::write(&patch_file, patch).unwrap();
    let out = Command::new("kubectl")
        .args(["patch", "--local", "-o", "json", "--type", kind, "-f"])
        .arg(&file)
        .arg("--patch-file")
        .arg(&patch_file)
        .output()
        .expect("kubectl");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        out.status.success(),
        "kubectl patch --local: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("kubectl's JSON")
}

fn ids(objects: &[Value]) -> BTreeSet<ObjectId> {
    objects.iter().map(|o| ObjectId::of(o).unwrap()).collect()
}

#[test]
fn kubectl_kustomize_builds_every_kustomization_when_installed() {
    if !has_kubectl() {
        eprintln!("kubectl is not installed: the kustomize build is checked by this file alone");
        return;
    }
    let built: BTreeMap<&str, Vec<Value>> = KUSTOMIZATIONS
        .iter()
        .map(|k| (*k, kubectl_kustomize(&repo().join("manifests").join(k))))
        .collect();
    // The same objects as this file's model of each build: no strategic merge is involved.
    assert_eq!(built["base"], base().build(&[]), "base");
    assert_eq!(built["overlays/agent-link-local"], agent_link_local().build(&[]));
    assert_eq!(ids(&built["base"]), ids(&base().build(&[])));

    let agent = |k: &str| -> DaemonSet {
        typed(find(&built[k], &ObjectId::new("DaemonSet", AGENT)), "built")
    };
    let image = container(pod_spec(&agent("base")), "agent").image.clone().unwrap();
    assert_eq!(Some(&image), base().images.get(IMAGE));
    let link_local = agent("overlays/agent-link-local");
    let link_local = container(pod_spec(&link_local), "agent");
    assert_eq!(link_local.image.as_ref(), Some(&image));
    assert_eq!(env(link_local, "NODELOCALDNS_HA_CLUSTER_DNS_IP"), None);
    assert_eq!(env(link_local, "NODELOCALDNS_HA_LOCAL_IP"), Some("__PILLAR__LOCAL__DNS__"));
}

/// The patches of node-local-dns as `kubectl patch` applies them (offline: `--local`), to every
/// flavour's DaemonSet, the image filled in as the install's NOTES fill it; then the removal.
#[test]
fn kubectl_patches_every_flavours_node_local_dns_when_installed() {
    if !has_kubectl() {
        eprintln!("kubectl is not installed: the patches are checked by this file alone");
        return;
    }
    let image = "registry.example/nodelocaldns-ha:0.1.0";
    let drain = read(&node_local_dns_patch_file("drain.yaml"))
        .replace(&format!("image: {IMAGE}\n"), &format!("image: {image}\n"));
    let args = read(&node_local_dns_patch_file("args.yaml"));
    let removal = read(&node_local_dns_patch_file("remove-drain.yaml"));
    for (flavour, ds) in flavour_daemonsets() {
        let before = node_cache_args(&ds);
        let with_args = kubectl_patch_local(&ds, "json", &args);
        let patched = kubectl_patch_local(&with_args, "strategic", &drain);
        let typed_ds: DaemonSet = typed(&patched, "patched");
        let spec = pod_spec(&typed_ds);
        let node_cache = container(spec, NODE_CACHE);
        let after = node_cache.args.clone().unwrap();
        assert_eq!(after[..before.len()], before[..], "{flavour}: node-cache's own args first");
        assert!(after.ends_with(&["-setupiptables=false".into(), "-skipteardown".into()]));
        let pre_stop = node_cache.lifecycle.as_ref().unwrap().pre_stop.as_ref().unwrap();
        let command = pre_stop.exec.as_ref().unwrap().command.as_ref().unwrap();
        assert!(command.contains(&"drain".into()), "{flavour}: {command:?}");
        let mounts: BTreeSet<&str> =
            node_cache.volume_mounts.iter().flatten().map(|m| m.mount_path.as_str()).collect();
        let expected = BTreeSet::from([XTABLES_LOCK, STATE_DIR, "/ha"]);
        assert!(mounts.is_superset(&expected), "{flavour}: {mounts:?}");
        let init = &spec.init_containers.as_ref().unwrap()[0];
        assert_eq!(init.image.as_deref(), Some(image), "{flavour}: the same image as the agent's");

        // The removal gives back the DaemonSet as it was before the drain, but for the grace
        // period the drain needed and an empty `lifecycle` where there was none.
        let removed = kubectl_patch_local(&patched, "strategic", &removal);
        let pod = |ds: &Value| ds["spec"]["template"]["spec"].clone();
        let (mut left, mut want) = (pod(&removed), pod(&with_args));
        for spec in [&mut left, &mut want] {
            let fields = spec.as_object_mut().unwrap();
            fields.remove("terminationGracePeriodSeconds");
            if fields.get("initContainers") == Some(&json!([])) {
                fields.remove("initContainers");
            }
            let cache = spec["containers"][0].as_object_mut().unwrap();
            if cache.get("lifecycle") == Some(&json!({})) {
                cache.remove("lifecycle");
            }
        }
        assert_eq!(left, want, "{flavour}: the removal left the drain's changes");
    }
}

// ---------------------------------------------------------------------------------------------
// The systemd unit

/// A unit file: section → key → values (a key may repeat).
type Unit = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn unit_text() -> String {
    read(&repo().join("packaging/nodelocaldns-ha.service"))
}

fn parse_unit(text: &str) -> Unit {
    let mut unit = Unit::new();
    let mut section = None;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        assert!(!line.ends_with('\\'), "line {}: keep each setting on one line", n + 1);
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.to_owned());
            continue;
        }
        let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("line {}: {line}", n + 1));
        let section = section.clone().unwrap_or_else(|| panic!("line {}: before a section", n + 1));
        let values = unit.entry(section).or_default().entry(key.trim().to_owned()).or_default();
        values.push(value.trim().to_owned());
    }
    unit
}

fn one<'a>(unit: &'a Unit, section: &str, key: &str) -> &'a str {
    match unit.get(section).and_then(|s| s.get(key)).map(Vec::as_slice) {
        Some([value]) => value,
        other => panic!("[{section}] {key}: {other:?}"),
    }
}

#[test]
fn the_unit_runs_the_agent_sandboxed_with_its_capabilities() {
    let unit = parse_unit(&unit_text());
    let sections: Vec<&str> = unit.keys().map(String::as_str).collect();
    assert_eq!(sections, ["Install", "Service", "Unit"]);
    let service = "Service";
    for (key, value) in [
        ("ExecStart", "/usr/local/bin/nodelocaldns-ha run"),
        ("EnvironmentFile", "-/etc/default/nodelocaldns-ha"),
        ("Restart", "always"),
        ("RuntimeDirectory", "nodelocaldns-ha"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("KillSignal", "SIGTERM"),
    ] {
        assert_eq!(one(&unit, service, key), value, "[Service] {key}");
    }
    let words = |key| one(&unit, service, key).split_whitespace().collect::<BTreeSet<_>>();
    let expected: BTreeSet<String> = CAPABILITIES.iter().map(|c| format!("CAP_{c}")).collect();
    let expected: BTreeSet<&str> = expected.iter().map(String::as_str).collect();
    assert_eq!(words("CapabilityBoundingSet"), expected, "the DaemonSet's capabilities");
    assert_eq!(words("AmbientCapabilities"), expected);
    let after: Vec<&str> =
        unit["Unit"]["After"].iter().flat_map(|v| v.split_whitespace()).collect();
    assert!(after.contains(&"network-online.target"), "{after:?}");
    assert_eq!(one(&unit, "Install", "WantedBy"), "multi-user.target");
    // Settings of [Unit] that systemd ignores (with a warning) in [Service].
    for key in ["StartLimitIntervalSec", "StartLimitBurst", "After", "Wants", "Requires"] {
        assert!(!unit[service].contains_key(key), "{key} belongs in [Unit]");
    }
    // The state dir is RuntimeDirectory's: /run/<name>.
    assert_eq!(format!("/run/{}", one(&unit, service, "RuntimeDirectory")), STATE_DIR);
}

#[test]
fn the_unit_documents_real_variables_and_its_exit_policy() {
    let text = unit_text();
    let flags = run_flags();
    let mut documented = BTreeSet::new();
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("NODELOCALDNS_HA_") {
            assert!(flags.contains_key(word), "{word}: no flag of `run` reads it");
            documented.insert(word);
        }
    }
    for required in ["NODELOCALDNS_HA_LOCAL_IP", "NODELOCALDNS_HA_CLUSTER_DNS_IP"] {
        assert!(documented.contains(required), "{required} is documented");
    }
    let comments: String = text.lines().filter(|l| l.starts_with('#')).collect();
    assert!(comments.contains("Exit policy"), "says what stopping leaves behind");
    assert!(comments.contains("ruleset of the current route"));
}

// ---------------------------------------------------------------------------------------------
// The Dockerfile

/// A Dockerfile's instructions (continuation lines joined, comments left out): the global ARGs
/// before the first FROM, then each stage's.
struct Dockerfile {
    args: Vec<(String, String)>,
    stages: Vec<Vec<(String, String)>>,
}

impl Dockerfile {
    fn load() -> Dockerfile {
        let text = read(&repo().join("Dockerfile"));
        let mut instructions = Vec::new();
        let mut current = String::new();
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with('#') || (current.is_empty() && trimmed.is_empty()) {
                continue;
            }
            match trimmed.strip_suffix('\\') {
                Some(head) => {
                    current.push_str(head);
                    current.push(' ');
                }
                None => {
                    current.push_str(trimmed);
                    let (keyword, rest) = current.split_once(' ').unwrap_or((&current, ""));
                    instructions.push((keyword.to_ascii_uppercase(), rest.trim().to_owned()));
                    current.clear();
                }
            }
        }
        assert!(current.is_empty(), "the Dockerfile ends inside an instruction");
        let (mut args, mut stages): (_, Vec<Vec<(String, String)>>) = (Vec::new(), Vec::new());
        for instruction in instructions {
            if instruction.0 == "FROM" {
                stages.push(Vec::new());
            }
            match stages.last_mut() {
                Some(stage) => stage.push(instruction),
                None if instruction.0 == "ARG" => args.push(instruction),
                None => panic!("{} before the first FROM", instruction.0),
            }
        }
        Dockerfile { args, stages }
    }
}

fn installs(stage: &[(String, String)]) -> BTreeSet<&str> {
    stage
        .iter()
        .filter(|(k, _)| k == "RUN")
        .filter_map(|(_, run)| run.split("apt-get install").nth(1))
        .flat_map(|rest| rest.split("&&").next().unwrap().split_whitespace())
        .filter(|word| !word.starts_with('-'))
        .collect()
}

/// The builder is a build argument (the test bed passes its own, ci/image/build.sh), defaulting
/// to the public rust image of a Debian release and a Rust that builds every crate; the image
/// itself is only the root file system ci/image/rootfs.sh assembles (tests/e2e_image.rs checks
/// what is in it).
#[test]
fn the_image_is_built_on_bookworm_and_runs_from_scratch() {
    let dockerfile = Dockerfile::load();
    assert_eq!(dockerfile.stages.len(), 2, "build, then runtime");
    let (build, runtime) = (&dockerfile.stages[0], &dockerfile.stages[1]);

    assert_eq!(build[0].1, "${RUST_IMAGE} AS build");
    let default = dockerfile
        .args
        .iter()
        .find_map(|(_, arg)| arg.strip_prefix("RUST_IMAGE="))
        .expect("ARG RUST_IMAGE=<the public builder>");
    let (image, tag) = default.rsplit_once(':').expect("an image:tag");
    assert_eq!(image, "docker.io/library/rust");
    let (version, release) = tag.split_once('-').expect("rust:VERSION-RELEASE");
    assert_eq!(release, "bookworm", "ci/image/build.sh makes a bookworm builder");
    // Every crate of the workspace: the image builds the agent and the webhook.
    let parts = |v: &str| v.split('.').map(|p| p.parse::<u32>().unwrap()).collect::<Vec<_>>();
    let members = ["Cargo.toml", "crates/webhook/Cargo.toml", "crates/dnsload/Cargo.toml"];
    for manifest in members {
        let msrv = read(&repo().join(manifest))
            .lines()
            .find_map(|l| l.strip_prefix("rust-version = ").map(|v| v.trim_matches('"').to_owned()))
            .unwrap_or_else(|| panic!("{manifest}: a rust-version"));
        assert!(
            parts(version) >= parts(&msrv),
            "rust {version} builds {manifest}, which needs {msrv}"
        );
    }
    assert!(installs(build).is_superset(&BTreeSet::from([
        "libnftnl-dev",
        "libmnl-dev",
        "pkg-config",
        "iptables",
    ])));
    assert!(build
        .iter()
        .any(|(k, run)| k == "RUN" && run.contains("cargo build --release --locked")));

    assert_eq!(runtime[0].1, "scratch");
    assert_eq!(runtime[1], ("COPY".to_owned(), "--from=build /rootfs /".to_owned()));
}

#[test]
fn the_image_ends_with_an_exec_form_entrypoint() {
    let dockerfile = Dockerfile::load();
    let exec_form = |rest: &str| serde_json::from_str::<Vec<String>>(rest).ok();
    for (keyword, rest) in dockerfile.stages.iter().flatten() {
        if keyword == "ENTRYPOINT" || keyword == "CMD" {
            assert!(exec_form(rest).is_some(), "{keyword} {rest}: exec form, no shell");
        }
    }
    let runtime = dockerfile.stages.last().unwrap();
    let mut tail = runtime.iter().rev();
    let (last, cmd) = tail.next().unwrap();
    assert_eq!((last.as_str(), exec_form(cmd)), ("CMD", Some(vec!["run".to_owned()])));
    let (last, entrypoint) = tail.next().unwrap();
    assert_eq!(last, "ENTRYPOINT");
    assert_eq!(exec_form(entrypoint), Some(vec!["/usr/local/bin/nodelocaldns-ha".to_owned()]));
}

/// Issue 17 (5): the agent probes a name of the cluster's own domain. Without `--probe-name` it
/// probes `kubernetes.default.svc.cluster.local`, which on a cluster with another domain is not
/// the cluster's and leaves it (the cache forwards it out). The base sets it from node-local-dns's
/// own domain placeholder, filled where the other placeholders are (one place to edit: the
/// `DOMAIN` of manifests/README.md's step 3).
#[test]
fn the_agent_probes_a_name_in_the_clusters_own_domain() {
    let ds = agent_daemonset();
    let agent = container(pod_spec(&ds), "agent");
    let name = setting(agent, "--probe-name", "NODELOCALDNS_HA_PROBE_NAME").unwrap_or_else(|| {
        panic!(
            "the agent's DaemonSet does not set --probe-name: the cluster's domain is never used"
        )
    });
    assert_eq!(name, "kubernetes.default.svc.__PILLAR__DNS__DOMAIN__");
    let filled = name.replace("__PILLAR__DNS__DOMAIN__", "corp.example");
    assert_eq!(filled, "kubernetes.default.svc.corp.example");
    let probe = nodelocaldns_ha::probe::Probe::new(&filled, Duration::from_millis(80));
    assert!(probe.is_ok(), "{filled}: {:?}", probe.err());
    // Everywhere the base's placeholders are filled, the domain is filled too.
    for file in ["manifests/base/kustomization.yaml", "manifests/README.md"] {
        let text = read(&repo().join(file));
        assert!(
            text.contains("s/__PILLAR__DNS__DOMAIN__/"),
            "{file} does not say how to fill in the cluster's domain"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Seen from the cluster (issue 19)

/// The first document of manifests/`path`.
fn monitoring_doc(path: &str) -> Value {
    file_docs(&repo().join("manifests").join(path)).remove(0)
}

/// Checks that `monitor` selects `daemonset`'s pods, and that each endpoint names a port of its
/// container `name`; returns those ports' numbers.
fn scraped_ports(monitor: &Value, daemonset: &DaemonSet, name: &str) -> Vec<i32> {
    let template = daemonset.spec.as_ref().unwrap().template.metadata.as_ref().unwrap();
    let labels = template.labels.clone().unwrap_or_default();
    let wanted = monitor["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels");
    assert!(!wanted.is_empty());
    for (key, value) in wanted {
        assert_eq!(labels.get(key).map(String::as_str), value.as_str(), "selector {key}");
    }
    let container = container(pod_spec(daemonset), name);
    let endpoints = monitor["spec"]["podMetricsEndpoints"].as_array().expect("endpoints");
    endpoints
        .iter()
        .map(|endpoint| {
            let port = endpoint["port"].as_str().expect("a port name");
            let relabel = endpoint["relabelings"].as_array().expect("relabelings");
            let node = relabel.iter().any(|r| {
                r["targetLabel"] == "node"
                    && r["sourceLabels"] == json!(["__meta_kubernetes_pod_node_name"])
            });
            assert!(node, "every series says its node: {endpoint}");
            let ports = container.ports.as_deref().unwrap_or_default();
            let found = ports.iter().find(|p| p.name.as_deref() == Some(port));
            found.unwrap_or_else(|| panic!("no port {port} in {name}")).container_port
        })
        .collect()
}

#[test]
fn the_pod_monitors_select_their_daemonsets_and_scrape_where_they_listen() {
    let ds = agent_daemonset();
    let agent = container(pod_spec(&ds), "agent");
    let addr = metrics_addr(agent);
    let monitor = monitoring_doc("monitoring/podmonitor.yaml");
    let ports = scraped_ports(&monitor, &ds, "agent");
    assert_eq!(ports, [i32::from(addr.port())], "the port the agent listens on");
    // The annotations of a Prometheus without the operator say the same.
    let template = ds.spec.as_ref().unwrap().template.metadata.clone().unwrap();
    let annotations = template.annotations.unwrap_or_default();
    assert_eq!(annotations.get("prometheus.io/scrape").map(String::as_str), Some("true"));
    assert_eq!(
        annotations.get("prometheus.io/port").map(String::as_str),
        Some(addr.port().to_string().as_str())
    );
    // node-local-dns's: its 9253, twice (the second endpoint moved to 9353).
    let stock: DaemonSet = typed(&stock_daemonset(), "stock node-local-dns");
    let monitor = monitoring_doc("monitoring/node-local-dns/podmonitor.yaml");
    assert_eq!(scraped_ports(&monitor, &stock, NODE_CACHE), [9253, 9253]);
    let moved = &monitor["spec"]["podMetricsEndpoints"][1]["relabelings"][0];
    assert_eq!(moved["targetLabel"], "__address__");
    assert_eq!(moved["replacement"], "$1:9353");
}

#[test]
fn the_dashboard_is_a_grafana_configmap_of_panels_with_queries() {
    let map: ConfigMap = typed(&monitoring_doc("monitoring/grafana-dashboard.yaml"), "dashboard");
    let labels = map.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("grafana_dashboard").map(String::as_str), Some("1"));
    let data = map.data.unwrap_or_default();
    let json: Value = serde_json::from_str(&data["nodelocaldns-ha.json"]).expect("dashboard JSON");
    let panels = json["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8, "{}", panels.len());
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty() && targets.iter().all(|t| t["expr"].is_string()), "{panel}");
    }
}

//! The alerting rules (issue 15): `manifests/monitoring/alerts.yaml`, checked with Prometheus's
//! own tools and run in a real Prometheus server (Debian's `prometheus` package, which
//! `ci/deps.sh` installs).
//!
//! * `promtool check rules`, and `promtool test rules` on `alerts_test.yaml`, whose cases make
//!   every alert fire and stay silent.
//! * The PrometheusRule (`prometheusrule.yaml`) is the rules file, generated from it:
//!   `NLHA_REGENERATE=1 cargo test --test alerts` writes it again.
//! * Every agent series a rule reads is one the agent serves; `promtool check metrics` on the
//!   live `/metrics`.
//! * End to end: Prometheus in the simulated node's namespace scrapes the agent every second and
//!   evaluates the shipped rules, their durations divided by [`SCALE`] (a 10-minute `for:`
//!   becomes 5 s): the agent-down, bypassed and flapping alerts each go pending, firing and
//!   resolved as the agent and the cache fail and recover.
//! * Seen from the cluster (issue 19): a Prometheus in a pod's namespace scrapes the agent where
//!   the DaemonSet puts it, through the PodMonitor's endpoint; the node-local IPs refuse a
//!   scrape; the Grafana dashboard's queries parse and return data.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;
use testkit::*;

fn monitoring() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/monitoring")
}

fn read(name: &str) -> String {
    let path = monitoring().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml(text: &str, origin: &str) -> Value {
    serde_norway::from_str(text).unwrap_or_else(|e| panic!("{origin}: {e}"))
}

/// Runs promtool with `args` in manifests/monitoring, `stdin` on its input.
fn promtool(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(monitoring())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): Debian's package prometheus has it (ci/deps.sh)")
        });
    child.stdin.take().expect("stdin").write_all(stdin.as_bytes()).expect("write to promtool");
    child.wait_with_output().expect("promtool's output")
}

/// The alerting rules of alerts.yaml, as JSON.
fn rules() -> Vec<Value> {
    let rules = yaml(&read("alerts.yaml"), "alerts.yaml");
    let groups = rules["groups"].as_array().expect("groups");
    groups.iter().flat_map(|g| g["rules"].as_array().expect("rules").clone()).collect()
}

#[test]
fn the_rules_pass_promtool_check_and_its_unit_tests() {
    let out = promtool(&["check", "rules", "alerts.yaml"], "");
    assert!(out.status.success(), "promtool check rules: {}", describe(&out));
    let out = promtool(&["test", "rules", "alerts_test.yaml"], "");
    assert!(out.status.success(), "promtool test rules: {}", describe(&out));
}

/// Each alert has a test case in which it fires (an expected alert) and an evaluation at which
/// it must be silent (none expected), besides the other nodes of its case that never fire.
#[test]
fn every_alert_is_tested_firing_and_silent() {
    let tests = yaml(&read("alerts_test.yaml"), "alerts_test.yaml");
    let mut firing = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for case in tests["tests"].as_array().expect("tests") {
        for eval in case["alert_rule_test"].as_array().expect("alert_rule_test") {
            let name = eval["alertname"].as_str().expect("alertname").to_owned();
            match eval["exp_alerts"].as_array().map(Vec::len) {
                Some(0) | None => silent.insert(name),
                Some(_) => firing.insert(name),
            };
        }
    }
    let alerts: BTreeSet<String> =
        rules().iter().map(|r| r["alert"].as_str().expect("an alert").to_owned()).collect();
    assert!(alerts.len() >= 9, "{alerts:?}");
    assert_eq!(firing, alerts, "alerts with a firing case (left), the rules' (right)");
    assert_eq!(silent, alerts, "alerts with a silent case (left), the rules' (right)");
    for rule in rules() {
        let name = rule["alert"].as_str().unwrap();
        let annotations = &rule["annotations"];
        for key in ["summary", "description"] {
            let text = annotations[key].as_str().unwrap_or_default();
            assert!(text.contains("{{ $labels.node }}") || key == "description", "{name}: {key}");
            assert!(!text.is_empty(), "{name}: no {key}");
        }
        assert!(rule["labels"]["severity"].is_string(), "{name}: no severity");
    }
}

/// What prometheusrule.yaml must be: the rules file's groups under a PrometheusRule's spec.
fn prometheus_rule(rules: &str) -> String {
    let groups = rules.find("groups:").expect("alerts.yaml has groups");
    let mut out = String::from(
        "# Generated from alerts.yaml by tests/alerts.rs (`NLHA_REGENERATE=1 cargo test --test alerts`):\n\
         # edit alerts.yaml, not this. The same rules for prometheus-operator; a Prometheus that selects\n\
         # rules by label (kube-prometheus-stack: `release: <its release>`) needs that label added.\n\
         apiVersion: monitoring.coreos.com/v1\n\
         kind: PrometheusRule\n\
         metadata:\n  name: nodelocaldns-ha\n  namespace: kube-system\n  labels:\n    \
         app.kubernetes.io/name: nodelocaldns-ha\n\
         spec:\n",
    );
    for line in rules[groups..].lines() {
        if !line.is_empty() {
            out.push_str("  ");
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[test]
fn the_prometheusrule_is_generated_from_the_rules_file() {
    let rules = read("alerts.yaml");
    let expected = prometheus_rule(&rules);
    let path = monitoring().join("prometheusrule.yaml");
    if std::env::var_os("NLHA_REGENERATE").is_some() {
        std::fs::write(&path, &expected).expect("write prometheusrule.yaml");
    }
    let shipped = std::fs::read_to_string(&path).expect("prometheusrule.yaml");
    assert!(
        shipped == expected,
        "prometheusrule.yaml is not alerts.yaml's: run `NLHA_REGENERATE=1 cargo test --test alerts`"
    );
    let object = yaml(&shipped, "prometheusrule.yaml");
    assert_eq!(object["spec"]["groups"], yaml(&rules, "alerts.yaml")["groups"]);
}

/// The agent's metric families the rules read (names starting `nodelocaldns_ha_`).
fn agent_series_read() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for rule in rules() {
        let expr = rule["expr"].as_str().expect("expr");
        for (at, _) in expr.match_indices("nodelocaldns_ha_") {
            let name: String =
                expr[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            names.insert(name);
        }
    }
    names
}

#[test]
fn every_series_the_rules_read_is_served() {
    let served = nodelocaldns_ha::metrics::Metrics::new().encode();
    let read = agent_series_read();
    assert!(read.len() >= 7, "{read:?}");
    for name in read {
        let sample = served
            .lines()
            .any(|l| l.strip_prefix(&name).is_some_and(|rest| rest.starts_with(['{', ' '])));
        assert!(sample, "{name} is read by a rule and not served:\n{served}");
    }
}

/// Durations of the rules divided by this in the end-to-end test.
const SCALE: u64 = 120;

/// `text` with every duration of a `for:` and of a range selector (`[1h]`) divided by `scale`,
/// in milliseconds.
fn scaled(text: &str, scale: u64) -> String {
    let ms = |d: &str| -> Option<String> {
        let unit = match d.trim_start_matches(|c: char| c.is_ascii_digit()) {
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return None,
        };
        let n: u64 = d.trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse().ok()?;
        Some(format!("{}ms", n * unit / scale))
    };
    let mut out = String::new();
    for line in text.lines() {
        let mut rest = line;
        if let Some((head, d)) = line.split_once("for: ").filter(|(h, _)| h.trim().is_empty()) {
            out.push_str(&format!("{head}for: {}", ms(d.trim()).expect("a for: duration")));
            rest = "";
        }
        while let Some(open) = rest.find('[') {
            let Some(len) = rest[open..].find(']') else { break };
            let inner = &rest[open + 1..open + len];
            out.push_str(&rest[..=open]);
            out.push_str(&ms(inner).unwrap_or_else(|| inner.to_owned()));
            out.push(']');
            rest = &rest[open + len + 1..];
        }
        out.push_str(rest);
        out.push('\n');
    }
    out
}

#[test]
fn scaling_divides_fors_and_ranges() {
    let text = "  for: 10m\n  expr: increase(x[1h]) > 6 and rate(y[30m])\n  foo: bar[x]\n";
    assert_eq!(
        scaled(text, 120),
        "  for: 5000ms\n  expr: increase(x[30000ms]) > 6 and rate(y[15000ms])\n  foo: bar[x]\n"
    );
}

/// A Prometheus server in a namespace of the simulated node (`role`), on its loopback; killed on
/// drop.
struct Prometheus<'a> {
    node: &'a SimNode,
    role: &'static str,
    child: Child,
    dir: PathBuf,
}

const PROMETHEUS: &str = "127.0.0.1:9090";
const JOB: &str = "kube-system/nodelocaldns-ha";
const NODE: &str = "sim-node";

impl<'a> Prometheus<'a> {
    /// In the node's namespace, scraping the agent's `/metrics` on loopback every second (job
    /// [`JOB`], label `node` [`NODE`]), evaluating `rules` every second.
    fn start(node: &'a SimNode, rules: &str) -> Prometheus<'a> {
        let scrape = format!(
            "- job_name: {JOB}\n  \
               static_configs: [{{targets: ['127.0.0.1:9254'], labels: {{node: {NODE}}}}}]\n"
        );
        Prometheus::start_in(node, "node", &scrape, rules)
    }

    /// In `role`'s namespace, with `scrape` as its scrape configs (scraping every second; one of
    /// them job [`JOB`], which it waits to see up) and `rules`.
    fn start_in(
        node: &'a SimNode,
        role: &'static str,
        scrape: &str,
        rules: &str,
    ) -> Prometheus<'a> {
        let dir = std::env::temp_dir().join(format!("{}-prometheus", node.ns(role)));
        std::fs::create_dir_all(&dir).expect("Prometheus's directory");
        std::fs::write(dir.join("alerts.yaml"), rules).expect("write the rules");
        let config = format!(
            "global: {{scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s}}\n\
             rule_files: [{rules}]\n\
             scrape_configs:\n{scrape}",
            rules = dir.join("alerts.yaml").display(),
        );
        std::fs::write(dir.join("prometheus.yml"), config).expect("write the config");
        let log = std::fs::File::create(dir.join("log")).expect("Prometheus's log");
        let child = node
            .cmd(role, "prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={PROMETHEUS}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start prometheus (Debian's package prometheus: ci/deps.sh)");
        let prometheus = Prometheus { node, role, child, dir };
        wait_for("Prometheus to scrape the agent", Duration::from_secs(30), || {
            let up = prometheus.get(&format!("/api/v1/query?query=up%7Bjob%3D%22{JOB}%22%7D"))?;
            let result = up["data"]["result"].as_array()?.first()?.clone();
            (result["value"][1] == "1").then_some(result)
        });
        prometheus
    }

    /// `GET path` (HTTP/1.0: the answer whole, never chunked), as JSON.
    fn get(&self, path: &str) -> Option<Value> {
        let script = format!(
            "exec 3<>/dev/tcp/127.0.0.1/9090 && printf '%s\\r\\n\\r\\n' 'GET {path} HTTP/1.0' >&3 && cat <&3"
        );
        let out = self.node.run(self.role, "bash", &["-c", &script]);
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.split_once("\r\n\r\n")?.1).ok()
    }

    /// The result of an instant query of `expr` (its series, maybe none).
    fn query(&self, expr: &str) -> Vec<Value> {
        let path = format!("/api/v1/query?query={}", percent_encoded(expr));
        let answer = self.get(&path).unwrap_or_else(|| panic!("no answer to {expr}"));
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The state of `alert` for this node: `pending`, `firing`, or `inactive`.
    fn state(&self, alert: &str) -> Option<(String, Value)> {
        let alerts = self.get("/api/v1/alerts")?;
        let mine = alerts["data"]["alerts"]
            .as_array()?
            .iter()
            .find(|a| a["labels"]["alertname"] == alert && a["labels"]["node"] == NODE);
        Some(match mine {
            Some(a) => (a["state"].as_str()?.to_owned(), a.clone()),
            None => ("inactive".to_owned(), Value::Null),
        })
    }

    /// Waits (up to 60 s) until `alert` is `want`; returns the states seen on the way, each
    /// once, in order, and the alert as Prometheus last showed it.
    fn wait(&self, alert: &str, want: &str) -> (Vec<String>, Value) {
        let mut seen: Vec<String> = Vec::new();
        let last = wait_for(&format!("{alert} {want}"), Duration::from_secs(60), || {
            let (state, value) = self.state(alert)?;
            if seen.last() != Some(&state) {
                seen.push(state.clone());
            }
            std::thread::sleep(Duration::from_millis(100));
            (state == want).then_some(value)
        });
        (seen, last)
    }

    /// Waits for `alert` to go pending, then firing; checks what it says.
    fn fires(&self, alert: &str) {
        let (seen, fired) = self.wait(alert, "firing");
        assert!(seen.contains(&"pending".to_owned()), "{alert} was never pending: {seen:?}");
        let summary = fired["annotations"]["summary"].as_str().unwrap_or_default();
        assert!(summary.contains(NODE), "{alert} does not name the node: {fired}");
        println!("{alert}: {seen:?}: {summary}");
    }

    fn resolves(&self, alert: &str) {
        let (seen, _) = self.wait(alert, "inactive");
        println!("{alert}: {seen:?}");
    }
}

impl Drop for Prometheus<'_> {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            eprintln!("Prometheus's log:\n{log}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Issue 15, acceptance 2: the shipped rules in a real Prometheus. The agent stopped: its
/// target down fires NodeLocalDNSHAAgentDown, which a restarted agent resolves. The cache killed
/// and left dead: NodeLocalDNSBypassed, resolved by the cache's return. The cache killed and
/// restarted four times: NodeLocalDNSRouteFlapping, resolved once the flaps leave its window.
/// Each goes pending, then firing, then inactive. And `promtool check metrics` passes the
/// agent's live `/metrics`.
#[test]
fn alerts_fire_and_resolve_in_a_real_prometheus() {
    let node = SimNode::up();
    let args = ["--interval", "100ms", "--min-hold", "500ms"];
    let mut agent = node.agent(&args);
    let (status, metrics) = node.http_get("/metrics");
    assert_eq!(status, 200);
    let out = promtool(&["check", "metrics"], &metrics);
    assert!(out.status.success(), "promtool check metrics: {}\n{metrics}", describe(&out));

    let prometheus = Prometheus::start(&node, &scaled(&read("alerts.yaml"), SCALE));
    for alert in ["NodeLocalDNSHAAgentDown", "NodeLocalDNSBypassed", "NodeLocalDNSRouteFlapping"] {
        assert_eq!(prometheus.state(alert).map(|s| s.0).as_deref(), Some("inactive"), "{alert}");
    }

    let previous = agent.state().expect("state");
    agent.stop(Signal::SIGTERM);
    prometheus.fires("NodeLocalDNSHAAgentDown");
    let agent = node.agent_restarting(&args, &previous);
    prometheus.resolves("NodeLocalDNSHAAgentDown");

    node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(10));
    prometheus.fires("NodeLocalDNSBypassed");
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    prometheus.resolves("NodeLocalDNSBypassed");

    // Two transitions so far; four more round trips make ten in the (scaled) hour.
    for _ in 0..4 {
        node.kill("cache-kill");
        agent.wait_route("upstream", Duration::from_secs(10));
        node.script(&["cache-start"]);
        agent.wait_route("local", Duration::from_secs(10));
    }
    prometheus.fires("NodeLocalDNSRouteFlapping");
    prometheus.resolves("NodeLocalDNSRouteFlapping");
    assert_eq!(prometheus.state("NodeLocalDNSBypassed").map(|s| s.0).as_deref(), Some("inactive"));
    drop(prometheus);
    node.tear_down(agent);
}

/// `text` for a URL's query: every byte but an unreserved one as `%XX`.
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The node's address on the pods' side in the simulated node (10.244.0.1 on each pod's veth),
/// where the DaemonSet's `[$(HOST_IP)]:9254` puts the agent.
const NODE_ADDRESS: &str = "10.244.0.1";

/// The dashboard's panels: (title, expressions), its variables as this test's Prometheus has
/// them (every node; a rate interval of 4 scrapes; a range of a minute).
fn dashboard_queries() -> Vec<(String, Vec<String>)> {
    let map = yaml(&read("grafana-dashboard.yaml"), "grafana-dashboard.yaml");
    let json = map["data"]["nodelocaldns-ha.json"].as_str().expect("the dashboard's JSON");
    let dashboard: Value = serde_json::from_str(json).expect("dashboard JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    panels
        .iter()
        .map(|panel| {
            let title = panel["title"].as_str().expect("a title").to_owned();
            let exprs = panel["targets"].as_array().expect("targets").iter().map(|t| {
                let expr = t["expr"].as_str().expect("expr");
                expr.replace("$__rate_interval", "4s")
                    .replace("$__range", "1m")
                    .replace("$node", ".*")
            });
            (title, exprs.collect())
        })
        .collect()
}

/// Issue 19. A Prometheus in a pod's namespace, reaching the node only over its veth, scrapes
/// the agent where the DaemonSet puts it (the node's address, port `metrics`) through the
/// shipped PodMonitor's endpoint rendered to a scrape config, and sees `up == 1` with the node
/// label; the node-local IPs, which every pod queries, refuse a scrape. Every dashboard query
/// parses (promtool) and, after a cache kill and recovery, returns data but those that read
/// node-local-dns's own metrics (`coredns_*`, which the simulated node's cache, unbound, does
/// not serve): the test lists each empty one.
#[test]
fn the_cluster_s_prometheus_scrapes_the_agent_on_the_node_s_address_only() {
    let empty = dashboard_after_a_kill_and_recovery(&[], false);
    assert_eq!(empty.len(), 1, "only node-local-dns's own request rate: {empty:#?}");
}

/// The same on the real parts, where the node-local cache is the real node-cache with
/// node-local-dns's Corefile, serving `coredns_dns_requests_total` on :9253, scraped as a second
/// job: every dashboard query returns data, node-local-dns's request rate included.
#[test]
fn the_dashboard_fills_on_the_real_parts_node_local_dns_request_rate_included() {
    let empty = dashboard_after_a_kill_and_recovery(&["--kube-proxy", "real-nftables"], true);
    assert!(empty.is_empty(), "dashboard queries with no data: {empty:#?}");
}

/// The body of the two tests above, on a node `up` with `options`; with `cache_metrics`, the
/// cache's :9253 is scraped too. Returns the dashboard queries left without data.
fn dashboard_after_a_kill_and_recovery(options: &[&str], cache_metrics: bool) -> Vec<String> {
    let node = SimNode::up_with(options);
    // The DaemonSet's address, `$(HOST_IP)` being the node's.
    let daemonset = Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/base/daemonset.yaml");
    let daemonset = yaml(&std::fs::read_to_string(daemonset).unwrap(), "daemonset.yaml");
    let agent_spec = &daemonset["spec"]["template"]["spec"]["containers"][0];
    let vars = agent_spec["env"].as_array().expect("env");
    let addr = vars.iter().find(|v| v["name"] == "NODELOCALDNS_HA_METRICS_ADDR").expect("set");
    let addr = addr["value"].as_str().unwrap().replace("$(HOST_IP)", NODE_ADDRESS);
    let args = ["--metrics-addr", &addr, "--interval", "100ms", "--min-hold", "500ms"];
    let agent = node.agent(&args);

    // The PodMonitor's endpoint: the DaemonSet's port of that name, its path, job
    // `<namespace>/<name>` as prometheus-operator names it, the node relabelling's label.
    let monitor = yaml(&read("podmonitor.yaml"), "podmonitor.yaml");
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    let ports = &agent_spec["ports"];
    let port = ports.as_array().unwrap().iter().find(|p| p["name"] == endpoint["port"]);
    let port = port.expect("the PodMonitor's port in the DaemonSet")["containerPort"].clone();
    let job = format!(
        "{}/{}",
        monitor["metadata"]["namespace"].as_str().unwrap(),
        monitor["metadata"]["name"].as_str().unwrap()
    );
    assert_eq!(job, JOB);
    let relabel = &endpoint["relabelings"][0];
    assert_eq!(relabel["targetLabel"], "node");
    let mut scrape = format!(
        "- job_name: {job}\n  metrics_path: {path}\n  \
           static_configs: [{{targets: ['{NODE_ADDRESS}:{port}'], labels: {{node: {NODE}}}}}]\n",
        path = endpoint["path"].as_str().unwrap(),
    );
    if cache_metrics {
        // node-local-dns's own metrics (its upstream manifest's prometheus.io/port: 9253).
        scrape += &format!(
            "- job_name: kube-system/node-local-dns\n  \
               static_configs: [{{targets: ['{NODE_ADDRESS}:9253'], labels: {{node: {NODE}}}}}]\n"
        );
    }
    let prometheus = Prometheus::start_in(&node, "pod2", &scrape, "groups: []\n");
    let up = prometheus.query(&format!(r#"up{{job="{JOB}"}}"#));
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0]["metric"]["node"], NODE, "{up:?}");
    if cache_metrics {
        let cache = r#"up{job="kube-system/node-local-dns"} == 1"#;
        wait_for("node-local-dns scraped", Duration::from_secs(30), || {
            (!prometheus.query(cache).is_empty()).then_some(())
        });
    }

    // From the same pod, the node-local IPs refuse what the node's address answers.
    let connects = |ip: &str| {
        let script = format!("exec 3<>/dev/tcp/{ip}/9254");
        node.run("pod2", "timeout", &["2", "bash", "-c", &script]).status.success()
    };
    assert!(connects(NODE_ADDRESS), "the node's address");
    for ip in [LOCAL_IP, CLUSTER_DNS_IP] {
        assert!(!connects(ip), "{ip}:9254 answered a pod");
    }

    // Every query parses: promtool checks them as recording rules.
    let queries = dashboard_queries();
    let mut rules = String::from("groups:\n- name: dashboard\n  rules:\n");
    for (i, (_, exprs)) in queries.iter().enumerate() {
        for (j, expr) in exprs.iter().enumerate() {
            rules.push_str(&format!("  - record: panel_{i}_{j}\n    expr: {}\n", json_str(expr)));
        }
    }
    let out = promtool(&["check", "rules", "/dev/stdin"], &rules);
    assert!(out.status.success(), "a dashboard query does not parse: {}\n{rules}", describe(&out));

    node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(10));
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    // The change and the recovery scraped, then the rate window filled.
    wait_for("the switch and the return scraped", Duration::from_secs(30), || {
        let changes = prometheus.query("sum(nodelocaldns_ha_route_transitions_total) >= 2");
        let local = prometheus.query(r#"nodelocaldns_ha_route{route="local"} == 1"#);
        (!changes.is_empty() && !local.is_empty()).then_some(())
    });
    // Until every query of the agent's metrics has data (the rate windows filled), or 30 s.
    let empty_queries = || {
        let mut empty = Vec::new();
        for (title, exprs) in &queries {
            for expr in exprs {
                if prometheus.query(expr).is_empty() {
                    empty.push(format!("{title}: {expr}"));
                }
            }
        }
        empty
    };
    let mut empty = Vec::new();
    let settled = poll(Duration::from_secs(30), || {
        empty = empty_queries();
        empty.iter().all(|q| q.contains("coredns_") && !cache_metrics).then_some(())
    });
    println!("dashboard queries with no data: {empty:#?}");
    assert!(settled.is_some(), "queries without data: {empty:#?}");
    drop(prometheus);
    node.tear_down(agent);
    empty
}

/// `text` as a double-quoted YAML (and JSON) string.
fn json_str(text: &str) -> String {
    serde_json::to_string(text).expect("a string")
}

//! Reviews as the API server sends them, and what it cannot read: each answered
//! without a patch, and named.

use serde_json::{json, Value};

use super::*;

fn settings() -> Settings {
    Settings {
        nameservers: vec!["169.254.20.10".into(), "10.96.0.10".into()],
        cluster_domain: "cluster.local".into(),
        options: vec![("ndots".into(), Some("3".into()))],
        host_network: false,
    }
}

const UID: &str = "705ab4f5-6393-11e8-b7cc-42010a800002";

/// A review of `object`, a `kind`, as the API server sends it for a `kubectl create`.
fn review(kind: Value, operation: &str, object: Option<Value>) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": UID,
            "kind": kind,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop",
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": object,
            "oldObject": null,
            "dryRun": false,
        }
    })
}

fn pod_kind() -> Value {
    json!({"group": "", "version": "v1", "kind": "Pod"})
}

/// A pod as a ReplicaSet creates it: a generated name, no namespace of its own yet.
fn pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "web-7d4b9c-", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "web", "image": "nginx"}], "dnsPolicy": "ClusterFirst"},
    })
}

fn send(review: &Value) -> (Answer, Value) {
    let answer = answer(&serde_json::to_vec(review).unwrap(), &settings());
    let body = serde_json::from_slice(&answer.body).expect("the answer is JSON");
    (answer, body)
}

/// The response part of an answer that allows the pod as it is.
fn assert_allowed_unpatched(body: &Value) {
    assert_eq!(body["apiVersion"], "admission.k8s.io/v1", "{body}");
    assert_eq!(body["kind"], "AdmissionReview", "{body}");
    assert_eq!(body["response"]["uid"], UID, "{body}");
    assert_eq!(body["response"]["allowed"], true, "{body}");
    assert!(body["response"].get("patch").is_none(), "{body}");
    assert!(body["response"].get("patchType").is_none(), "{body}");
}

#[test]
fn a_pod_is_patched_and_the_patch_applies() {
    let (answer, body) = send(&review(pod_kind(), "CREATE", Some(pod())));
    assert_eq!((answer.status, &answer.outcome), (200, &Outcome::Mutated));
    let response = &body["response"];
    assert_eq!(response["uid"], UID);
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    // kube-core writes the patch's bytes as a JSON array of numbers (Go reads that into a
    // []byte as it reads base64).
    let patch: Vec<u8> = serde_json::from_value(response["patch"].clone()).expect("the patch");
    let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
    let mut pod = pod();
    json_patch::patch(&mut pod, &patch).expect("the patch applies");
    assert_eq!(pod["spec"]["dnsPolicy"], "None");
    assert_eq!(
        pod["spec"]["dnsConfig"],
        json!({
            "nameservers": ["169.254.20.10", "10.96.0.10"],
            "searches": ["shop.svc.cluster.local", "svc.cluster.local", "cluster.local"],
            "options": [{"name": "ndots", "value": "3"}],
        })
    );
    assert_eq!(pod["metadata"]["annotations"][mutate::MARK], mutate::MARKED);
    // A second pass (reinvocation) on the patched pod changes nothing.
    let (again, body) = send(&review(pod_kind(), "CREATE", Some(pod)));
    assert_eq!(again.outcome, Outcome::Skipped(Skip::AlreadyMutated));
    assert_allowed_unpatched(&body);
}

#[test]
fn a_skipped_pod_is_allowed_unpatched() {
    let mut own = pod();
    own["spec"]["dnsPolicy"] = json!("Default");
    let (answer, body) = send(&review(pod_kind(), "CREATE", Some(own)));
    assert_eq!((answer.status, answer.outcome), (200, Outcome::Skipped(Skip::OwnPolicy)));
    assert_allowed_unpatched(&body);
}

#[test]
fn malformed_json_is_refused_without_a_patch() {
    for bad in [&b"{\"apiVersion\": \"admission.k8s.io/v1\", "[..], b"", b"\xff\xfe", b"[1, 2]"] {
        let answer = answer(bad, &settings());
        assert_eq!(answer.status, 400);
        assert!(
            matches!(&answer.outcome, Outcome::Malformed(why) if why.contains("not an AdmissionReview"))
        );
        let body: Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(body["response"]["allowed"], false, "{body}");
        assert!(body["response"].get("patch").is_none(), "{body}");
    }
}

#[test]
fn a_review_without_a_request_is_refused() {
    let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"});
    let answer = answer(&serde_json::to_vec(&body).unwrap(), &settings());
    assert_eq!(answer.status, 400);
    assert!(
        matches!(&answer.outcome, Outcome::Malformed(why) if why.contains("without a request"))
    );
}

#[test]
fn another_kind_is_allowed_unpatched() {
    let service = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}});
    let kind = json!({"group": "", "version": "v1", "kind": "Service"});
    let (answer, body) = send(&review(kind, "CREATE", Some(service)));
    assert_eq!(answer.status, 200);
    assert_eq!(answer.outcome, Outcome::Unexpected("a review of /v1 Service".into()));
    assert_allowed_unpatched(&body);
}

#[test]
fn a_review_with_no_object_is_allowed_unpatched() {
    let (answer, body) = send(&review(pod_kind(), "CREATE", None));
    assert_eq!(answer.outcome, Outcome::Unexpected("a review with no object".into()));
    assert_allowed_unpatched(&body);
}

#[test]
fn an_update_is_allowed_unpatched() {
    let (answer, body) = send(&review(pod_kind(), "UPDATE", Some(pod())));
    assert_eq!(answer.outcome, Outcome::Unexpected("a Update of a pod".into()));
    assert_allowed_unpatched(&body);
}

#[test]
fn an_object_that_is_no_pod_is_allowed_unpatched() {
    let mut bad = pod();
    bad["spec"] = json!("not a spec");
    let (answer, body) = send(&review(pod_kind(), "CREATE", Some(bad)));
    assert!(
        matches!(&answer.outcome, Outcome::Unexpected(why) if why.starts_with("an object that is no pod"))
    );
    assert_allowed_unpatched(&body);
}

/// kube-core's answer, from the whole review as it reads it, with `patch` if there is one: what
/// the webhook answered before it read reviews itself.
fn kube_cores(review: &Value, patch: Option<&Value>) -> Value {
    use kube_core::admission::{AdmissionRequest, AdmissionReview};
    let review: AdmissionReview<kube_core::DynamicObject> =
        serde_json::from_value(review.clone()).unwrap();
    let request: AdmissionRequest<_> = review.try_into().unwrap();
    let mut response = AdmissionResponse::from(&request);
    if let Some(patch) = patch {
        let bytes: Vec<u8> = serde_json::from_value(patch.clone()).unwrap();
        response = response.with_patch(serde_json::from_slice(&bytes).unwrap()).unwrap();
    }
    serde_json::to_value(response.into_review()).unwrap()
}

#[test]
fn answers_are_those_kube_core_makes_of_the_whole_review() {
    let mut other = pod();
    other["spec"]["dnsPolicy"] = json!("Default");
    let service = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}});
    let mut status = review(pod_kind(), "UPDATE", Some(pod()));
    status["request"]["subResource"] = json!("status");
    let mut beta = review(pod_kind(), "CREATE", Some(pod()));
    beta["apiVersion"] = json!("admission.k8s.io/v1beta1");
    for review in [
        review(pod_kind(), "CREATE", Some(pod())),
        review(pod_kind(), "CREATE", Some(other)),
        review(json!({"group": "", "version": "v1", "kind": "Service"}), "CREATE", Some(service)),
        review(pod_kind(), "UPDATE", Some(pod())),
        review(pod_kind(), "CREATE", None),
        status,
        beta,
    ] {
        let (_, ours) = send(&review);
        assert_eq!(ours, kube_cores(&review, ours["response"].get("patch")), "{review}");
    }
}

#[test]
fn a_review_whose_answer_would_repeat_a_long_member_is_refused() {
    let long = "u".repeat(MAX_ECHOED + 1);
    for member in ["/apiVersion", "/kind", "/request/uid"] {
        let mut review = review(pod_kind(), "CREATE", Some(pod()));
        *review.pointer_mut(member).unwrap() = json!(long);
        let (answer, body) = send(&review);
        assert_eq!(answer.status, 400, "{member}");
        assert!(
            matches!(&answer.outcome, Outcome::Malformed(why) if why.contains("over 256 bytes"))
        );
        assert!(answer.body.len() < 1024, "{member}: {body}");
    }
}

#[test]
fn what_a_client_sent_is_never_repeated_at_length() {
    let huge = "k".repeat(1 << 20);
    let mut bad_kind = review(pod_kind(), "CREATE", Some(pod()));
    bad_kind["request"]["kind"]["kind"] = json!(huge);
    let mut bad_operation = review(pod_kind(), "CREATE", Some(pod()));
    bad_operation["request"]["operation"] = json!(huge);
    let mut bad_object = review(pod_kind(), "CREATE", Some(pod()));
    bad_object["request"]["object"]["kind"] = json!(huge);
    let mut subresource = review(pod_kind(), "CREATE", Some(pod()));
    subresource["request"]["subResource"] = json!(huge);
    for review in [bad_kind, bad_operation, bad_object, subresource] {
        let (answer, _) = send(&review);
        let (Outcome::Unexpected(text) | Outcome::Malformed(text)) = &answer.outcome else {
            panic!("{:?}", answer.outcome)
        };
        assert!(text.len() < MAX_NOTE + 64 && text.contains("(cut: "), "{text}");
        assert!(answer.body.len() < 2048, "{} bytes", answer.body.len());
    }
    let answer = answer(format!("{{\"apiVersion\": {huge}").as_bytes(), &settings());
    assert!(matches!(&answer.outcome, Outcome::Malformed(why) if why.len() < MAX_NOTE + 64));
}

#[test]
fn clipped_text_is_cut_at_a_character_and_says_so() {
    assert_eq!(clipped("short"), "short");
    let text = "é".repeat(MAX_NOTE);
    let cut = clipped(&text);
    assert!(cut.starts_with(&"é".repeat(MAX_NOTE / 2)), "{cut}");
    assert!(cut.ends_with(&format!("… (cut: {} bytes in all)", 2 * MAX_NOTE)), "{cut}");
}

#[test]
fn a_pod_of_millions_of_tiny_elements_is_mutated_in_one_pass() {
    let mut big = pod();
    big["spec"]["containers"][0]["args"] = json!(vec![0; 1_000_000]);
    let depth = 100_000;
    let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let mut text = serde_json::to_string(&review(pod_kind(), "CREATE", Some(big))).unwrap();
    text = text.replacen("\"nginx\"", &nested, 1);
    let answer = answer(text.as_bytes(), &settings());
    assert_eq!((answer.status, answer.outcome), (200, Outcome::Mutated));
}

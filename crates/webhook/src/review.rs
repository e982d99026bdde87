//! One AdmissionReview, from the request's body to the response's: the mutation's answer, or,
//! for anything else, `allowed: true` without a patch. Only the members the webhook needs are
//! read (the review's head, then what [`PodDns`] reads of the pod); the rest is walked past
//! without being built, so a review costs its body and little more, whatever it holds.
//!
//! The webhook never blocks a pod: a review it cannot read is answered with an HTTP error, which
//! the API server meets with the configuration's `failurePolicy: Ignore` (the pod is created as
//! it is); a review it can read but does not expect (another kind, another operation, no
//! object, an object that is no pod) is allowed as it is. Each such input is one [`Outcome`] the
//! server logs once and counts, what the client sent cut short ([`clipped`]).

use kube_core::admission::{AdmissionResponse, Operation};
use kube_core::{GroupVersionKind, Status, TypeMeta};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::mutate::{self, Settings, Skip};
use crate::pod::PodDns;

/// The longest member of a review its answer repeats (`apiVersion`, `kind`, `uid`): the API
/// server's are a few dozen bytes, and an answer stays small whatever was sent.
pub const MAX_ECHOED: usize = 256;
/// The most of a client's text an outcome carries (into the log, and into a refusal's answer).
pub const MAX_NOTE: usize = 256;

/// An AdmissionReview as far as the webhook reads it. Its members are those kube-core's
/// `AdmissionReview` requires; everything else is skipped unread, and the object is kept as the
/// text it came as, read further only once the review is known to be of a pod
/// ([`PodDns::from_json`]).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review<'a> {
    api_version: String,
    kind: String,
    #[serde(borrow)]
    request: Option<Request<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request<'a> {
    uid: String,
    kind: GroupVersionKind,
    #[allow(dead_code)] // Required, as kube-core requires it; not read.
    resource: IgnoredAny,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    operation: Operation,
    #[allow(dead_code)] // Required, as kube-core requires it; not read.
    user_info: IgnoredAny,
    #[serde(borrow)]
    object: Option<&'a RawValue>,
}

/// What became of one review.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The pod was given the nameservers.
    Mutated,
    /// The pod was left as it is, for this reason.
    Skipped(Skip),
    /// The review was allowed as it is: it was not what the webhook expects.
    Unexpected(String),
    /// The body was no AdmissionReview: answered with an HTTP error.
    Malformed(String),
}

impl Outcome {
    /// The `result` label of the reviews counter.
    pub fn result(&self) -> &'static str {
        match self {
            Outcome::Mutated => "mutated",
            Outcome::Skipped(_) => "skipped",
            Outcome::Unexpected(_) => "unexpected",
            Outcome::Malformed(_) => "malformed",
        }
    }
}

/// An HTTP answer: its status and JSON body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
    pub outcome: Outcome,
}

/// Answers the AdmissionReview in `body`.
pub fn answer(body: &[u8], settings: &Settings) -> Answer {
    let review: Review = match serde_json::from_slice(body) {
        Ok(review) => review,
        Err(e) => return malformed(&format!("not an AdmissionReview: {e}")),
    };
    let Some(request) = review.request else {
        return malformed("an AdmissionReview without a request");
    };
    for (member, value) in
        [("apiVersion", &review.api_version), ("kind", &review.kind), ("request.uid", &request.uid)]
    {
        if value.len() > MAX_ECHOED {
            return malformed(&format!(
                "an AdmissionReview whose {member} is over {MAX_ECHOED} bytes"
            ));
        }
    }
    let types = TypeMeta { api_version: review.api_version, kind: review.kind };
    let allowed = allowed(types, &request.uid);
    let (response, outcome) = match decide(&request, settings) {
        Ok(patch) => match allowed.clone().with_patch(patch) {
            Ok(response) => (response, Outcome::Mutated),
            Err(e) => (allowed, Outcome::Unexpected(e.to_string())),
        },
        Err(outcome) => (allowed, outcome),
    };
    let body = serde_json::to_vec(&response.into_review()).expect("an AdmissionReview serializes");
    Answer { status: 200, body, outcome }
}

/// The answer that allows the review's object as it is: what kube-core's
/// `AdmissionResponse::from` makes of a whole `AdmissionRequest` (its types and uid), from the
/// members read.
fn allowed(types: TypeMeta, uid: &str) -> AdmissionResponse {
    let mut response = AdmissionResponse::invalid("");
    response.types = types;
    response.uid = uid.to_owned();
    response.allowed = true;
    response.result = Status::default();
    response
}

/// The patch for `request`'s pod, or why there is none.
fn decide(request: &Request, settings: &Settings) -> Result<json_patch::Patch, Outcome> {
    let unexpected = |what: String| Err(Outcome::Unexpected(clipped(&what)));
    let kind = &request.kind;
    if (kind.group.as_str(), kind.version.as_str(), kind.kind.as_str()) != ("", "v1", "Pod") {
        return unexpected(format!("a review of {}/{} {}", kind.group, kind.version, kind.kind));
    }
    if request.operation != Operation::Create {
        return unexpected(format!("a {:?} of a pod", request.operation));
    }
    if let Some(sub_resource) = &request.sub_resource {
        return unexpected(format!("a review of pods/{sub_resource}"));
    }
    let Some(object) = request.object else {
        return unexpected("a review with no object".into());
    };
    let pod = match PodDns::from_json(object.get()) {
        Ok(pod) => pod,
        Err(e) => return unexpected(format!("an object that is no pod: {e}")),
    };
    let namespace = request.namespace.as_deref().unwrap_or_default();
    let mutation = mutate::mutate_dns(&pod, namespace, settings).map_err(Outcome::Skipped)?;
    let ops = mutation.patch.iter().map(|op| op.to_json()).collect();
    let patch = serde_json::from_value(serde_json::Value::Array(ops))
        .expect("the mutation's operations are a JSON patch");
    Ok(patch)
}

fn malformed(why: &str) -> Answer {
    let why = clipped(why);
    let body = serde_json::to_vec(&AdmissionResponse::invalid(&why).into_review())
        .expect("an AdmissionReview serializes");
    Answer { status: 400, body, outcome: Outcome::Malformed(why) }
}

/// `text` cut to at most [`MAX_NOTE`] bytes, at a character's boundary, and then said to be
/// cut: what a client sent is never repeated at length.
pub fn clipped(text: &str) -> String {
    if text.len() <= MAX_NOTE {
        return text.to_owned();
    }
    let mut end = MAX_NOTE;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… (cut: {} bytes in all)", &text[..end], text.len())
}

#[cfg(test)]
mod tests;

//! One AdmissionReview, from the request's body to the response's: the mutation's answer, or,
//! for anything else, `allowed: true` without a patch. The webhook never blocks a pod: a review
//! it cannot read is answered with an HTTP error, which the API server meets with the
//! configuration's `failurePolicy: Ignore` (the pod is created as it is); a review it can read
//! but does not expect (another kind, another operation, no object, an object that is no pod) is
//! allowed as it is. Each such input is one [`Outcome`] the server logs once and counts.

use k8s_openapi::api::core::v1::Pod;
use kube_core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube_core::DynamicObject;

use crate::mutate::{self, Settings, Skip};

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
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(review) => review,
        Err(e) => return malformed(format!("not an AdmissionReview: {e}")),
    };
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return malformed(format!("an AdmissionReview without a request: {e}")),
    };
    let response = AdmissionResponse::from(&request);
    let (response, outcome) = match decide(&request, settings) {
        Ok(patch) => match response.with_patch(patch) {
            Ok(response) => (response, Outcome::Mutated),
            Err(e) => (AdmissionResponse::from(&request), Outcome::Unexpected(e.to_string())),
        },
        Err(outcome) => (response, outcome),
    };
    let body = serde_json::to_vec(&response.into_review()).expect("an AdmissionReview serializes");
    Answer { status: 200, body, outcome }
}

/// The patch for `request`'s pod, or why there is none.
fn decide(
    request: &AdmissionRequest<DynamicObject>,
    settings: &Settings,
) -> Result<json_patch::Patch, Outcome> {
    let unexpected = |what: String| Err(Outcome::Unexpected(what));
    let kind = &request.kind;
    if (kind.group.as_str(), kind.version.as_str(), kind.kind.as_str()) != ("", "v1", "Pod") {
        return unexpected(format!("a review of {}/{} {}", kind.group, kind.version, kind.kind));
    }
    if request.operation != Operation::Create {
        return unexpected(format!("a {:?} of a pod", request.operation));
    }
    if request.sub_resource.is_some() {
        return unexpected(format!(
            "a review of pods/{}",
            request.sub_resource.as_deref().unwrap()
        ));
    }
    let Some(object) = &request.object else {
        return unexpected("a review with no object".into());
    };
    let pod: Pod = match serde_json::to_value(object).and_then(serde_json::from_value) {
        Ok(pod) => pod,
        Err(e) => return unexpected(format!("an object that is no pod: {e}")),
    };
    let namespace = request.namespace.as_deref().unwrap_or_default();
    let mutation = mutate::mutate(&pod, namespace, settings).map_err(Outcome::Skipped)?;
    let ops = mutation.patch.iter().map(|op| op.to_json()).collect();
    let patch = serde_json::from_value(serde_json::Value::Array(ops))
        .expect("the mutation's operations are a JSON patch");
    Ok(patch)
}

fn malformed(why: String) -> Answer {
    let body = serde_json::to_vec(&AdmissionResponse::invalid(&why).into_review())
        .expect("an AdmissionReview serializes");
    Answer { status: 400, body, outcome: Outcome::Malformed(why) }
}

#[cfg(test)]
mod tests;

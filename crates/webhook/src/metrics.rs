//! The webhook's Prometheus metrics, in the OpenMetrics text format.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `nodelocaldns_ha_webhook_reviews_total` | counter | `result` (`mutated`, `skipped`, `unexpected`, `malformed`, `too_large`, `timeout`), `reason` (a skip's) |
//! | `nodelocaldns_ha_webhook_review_duration_seconds` | histogram | |
//! | `nodelocaldns_ha_webhook_certificate_reloads_total` | counter | `result` (`loaded`, `failed`) |
//! | `nodelocaldns_ha_webhook_connections_cut_total` | counter | `reason` (`evicted`, `refused`, `idle`) |

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::review::Outcome;

/// Review durations, in seconds: 25 µs (a skip) to 100 ms (far past any review).
const BUCKETS: [f64; 10] =
    [0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.01, 0.025, 0.1];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReviewLabels {
    result: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CutLabels {
    reason: &'static str,
}

/// Every metric family of the webhook.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reviews: Family<ReviewLabels, Counter>,
    duration: Histogram,
    reloads: Family<ReloadLabels, Counter>,
    cuts: Family<CutLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("nodelocaldns_ha_webhook");
        let reviews = Family::<ReviewLabels, Counter>::default();
        registry.register(
            "reviews",
            "AdmissionReviews answered, by what became of them",
            reviews.clone(),
        );
        let duration = Histogram::new(BUCKETS);
        registry.register(
            "review_duration_seconds",
            "Time to answer a review, body read",
            duration.clone(),
        );
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "certificate_reloads",
            "Changes of the certificate's files, loaded or not",
            reloads.clone(),
        );
        let cuts = Family::<CutLabels, Counter>::default();
        registry.register(
            "connections_cut",
            "Connections closed by the webhook: given way to another's (evicted), no place made \
             for them (refused), or idle",
            cuts.clone(),
        );
        // Created at zero, so that the first of each counts in `increase()`.
        for result in ["mutated", "malformed", "too_large", "timeout"] {
            let _ = reviews.get_or_create(&ReviewLabels { result, reason: "" });
        }
        for result in ["loaded", "failed"] {
            let _ = reloads.get_or_create(&ReloadLabels { result });
        }
        for reason in ["evicted", "refused", "idle"] {
            let _ = cuts.get_or_create(&CutLabels { reason });
        }
        Metrics { registry, reviews, duration, reloads, cuts }
    }
}

impl Metrics {
    /// Counts a review answered in `took`.
    pub fn review(&self, outcome: &Outcome, took: Duration) {
        let reason = match outcome {
            Outcome::Skipped(skip) => skip.label(),
            _ => "",
        };
        self.reviews.get_or_create(&ReviewLabels { result: outcome.result(), reason }).inc();
        self.duration.observe(took.as_secs_f64());
    }

    /// Counts a body refused for its size.
    pub fn too_large(&self) {
        self.reviews.get_or_create(&ReviewLabels { result: "too_large", reason: "" }).inc();
    }

    /// Counts a review whose body did not arrive, or could not be given room or a turn to be
    /// decided, in time.
    pub fn timed_out(&self) {
        self.reviews.get_or_create(&ReviewLabels { result: "timeout", reason: "" }).inc();
    }

    /// Counts a connection closed by the webhook, for `reason` (`evicted`, `refused`, `idle`).
    pub fn cut(&self, reason: &'static str) {
        self.cuts.get_or_create(&CutLabels { reason }).inc();
    }

    /// Counts a reload of the certificate's files.
    pub fn reload(&self, loaded: bool) {
        let result = if loaded { "loaded" } else { "failed" };
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}

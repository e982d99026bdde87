//! The Prometheus text format (0.0.4) of a scrape, from the OpenMetrics one the registry
//! writes: what `/metrics` serves a client that does not ask for OpenMetrics (curl, promtool
//! check metrics, older collectors), as client_golang does.
//!
//! The two differ, for the families here, only in their metadata: a counter family is named with
//! its `_total` in text 0.0.4 (OpenMetrics names it without, and its samples with), text 0.0.4
//! has no `# UNIT` line and no `# EOF`, and its help text escapes no double quote. Samples
//! (counters' `_total`, histograms' `_bucket`, `_sum`, `_count`) are written the same.

/// `openmetrics` (one exposition, `# EOF` included) in the text format 0.0.4.
pub(super) fn from_openmetrics(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // A family's HELP line waits for its TYPE line, which says whether it names a counter.
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = rest.split_once(' ').or(Some((rest, "")));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let name = if kind == "counter" { format!("{name}_total") } else { name.to_owned() };
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {}\n", text.replace("\\\"", "\"")));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if !(line.starts_with("# UNIT ") || line == "# EOF") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_take_their_total_and_units_and_eof_go() {
        let open = "# HELP x_probes DNS \\\"probes\\\".\n# TYPE x_probes counter\n\
                    x_probes_total{a=\"b\"} 3\n\
                    # HELP x_apply_seconds Time.\n# TYPE x_apply_seconds histogram\n\
                    # UNIT x_apply_seconds seconds\nx_apply_seconds_bucket{le=\"+Inf\"} 1\n\
                    x_apply_seconds_sum 0.5\nx_apply_seconds_count 1\n\
                    # HELP x_route Route.\n# TYPE x_route gauge\nx_route 1\n# EOF\n";
        let text = "# HELP x_probes_total DNS \"probes\".\n# TYPE x_probes_total counter\n\
                    x_probes_total{a=\"b\"} 3\n\
                    # HELP x_apply_seconds Time.\n# TYPE x_apply_seconds histogram\n\
                    x_apply_seconds_bucket{le=\"+Inf\"} 1\n\
                    x_apply_seconds_sum 0.5\nx_apply_seconds_count 1\n\
                    # HELP x_route Route.\n# TYPE x_route gauge\nx_route 1\n";
        assert_eq!(from_openmetrics(open), text);
    }
}

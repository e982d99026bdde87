//! `dnsload`: see the library's documentation (`crates/dnsload/src/lib.rs`).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use dnsload::{run, Args, SYSTEM_LOOKUP_BUDGET};

fn main() -> ExitCode {
    let args = Args::parse();
    let mut builder = tokio::runtime::Builder::new_current_thread();
    if args.system_resolver {
        // One blocking thread per lookup in flight: a lookup never waits for a free thread.
        let most = f64::from(args.rate) * SYSTEM_LOOKUP_BUDGET.as_secs_f64();
        builder.max_blocking_threads((most as usize + 100).min(50_000));
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dnsload: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(summary) => {
            println!("SUMMARY {summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dnsload: {e}");
            ExitCode::FAILURE
        }
    }
}

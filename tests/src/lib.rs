//! Integration tests for Steward, run against a real control plane started by
//! [`steward_testenv`]. The tests live in `tests/tests/*.rs`; run them with `cargo xtask test`.

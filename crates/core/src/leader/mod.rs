//! Lease-based leader election (placeholder).

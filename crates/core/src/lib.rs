//! steward-core

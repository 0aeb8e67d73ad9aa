//! The registry of the workspace's operators: `cargo xtask` (crdgen, image) and the deploy
//! tests iterate [`all`] instead of naming operators. Adding an operator crate is one line
//! here (and the crate, and its workspace member line).

use steward_core::operator::Entry;

/// Every operator of the workspace, by name.
pub fn all() -> Vec<Entry> {
    vec![
        Entry::of::<database_operator::DatabaseOperator>(),
        Entry::of::<tenant_operator::TenantOperator>(),
        Entry::of::<upgrade_orchestrator::UpgradeOrchestrator>(),
    ]
}

/// The operator named `name`.
pub fn find(name: &str) -> Option<Entry> {
    all().into_iter().find(|entry| entry.name == name)
}

/// Every operator's name.
pub fn names() -> Vec<&'static str> {
    all().iter().map(|entry| entry.name).collect()
}

//! The registry of the workspace's operators: `cargo xtask` (crdgen, helm, image, bench) and the
//! tests iterate [`all`] instead of naming operators, and reach each operator crate through its
//! re-export here (`steward_operators::tenant_operator`). Adding an operator crate is one line
//! in the list at the end of this file and its dependency line in this crate's `Cargo.toml`
//! (the workspace's members are `crates/*`; `cargo xtask new-operator` writes both lines).

use steward_core::operator::Entry;

/// The operator named `name`.
pub fn find(name: &str) -> Option<Entry> {
    all().into_iter().find(|entry| entry.name == name)
}

/// Every operator's name.
pub fn names() -> Vec<&'static str> {
    all().iter().map(|entry| entry.name).collect()
}

/// Re-exports each operator crate and lists its [`Entry`] in [`all`], in the order given.
macro_rules! registry {
    ($($krate:ident::$definition:ident),* $(,)?) => {
        $(pub use $krate;)*

        /// Every operator of the workspace, by name.
        pub fn all() -> Vec<Entry> {
            vec![$(Entry::of::<$krate::$definition>()),*]
        }
    };
}

// One line per operator: `<crate>::<its steward_core::operator::Definition>`.
registry! {
    database_operator::DatabaseOperator,
    tenant_operator::TenantOperator,
    upgrade_orchestrator::UpgradeOrchestrator,
}

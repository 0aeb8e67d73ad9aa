//! Every CRD of every registered operator follows Steward's conventions
//! ([`steward_core::operator::crd_conventions`]). (Kept out of `src/lib.rs`, whose end is the
//! registry list `cargo xtask new-operator` appends to.)

#[test]
fn every_crd_follows_the_conventions() {
    for entry in steward_operators::all() {
        for crd in (entry.crds)() {
            let missed = steward_core::operator::crd_conventions(&crd);
            assert!(
                missed.is_empty(),
                "{} ({}): {}",
                crd.metadata.name.unwrap_or_default(),
                entry.name,
                missed.join("; ")
            );
        }
    }
}

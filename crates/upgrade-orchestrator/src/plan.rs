//! Validate: the dependency graph of a plan's components, and its waves.
//!
//! Wave 1 holds the components without dependencies; a component is in wave `1 + the highest
//! wave of its dependencies`. Waves run one after the other, so every component starts after
//! all of its dependencies finished. Within a wave, components are ordered by name.
//!
//! Pure: no client, unit-tested below.

use std::collections::{BTreeMap, BTreeSet};

use crate::crd::{Component, TargetKind};

/// Why a plan cannot run. Reported as `Valid=False` with [`Invalid::reason`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// The plan lists no components.
    #[error("the plan has no components")]
    NoComponents,
    /// Two components share a name.
    #[error("component name {0:?} is used more than once")]
    DuplicateName(String),
    /// `dependsOn` names a component that does not exist.
    #[error("component {component:?} depends on unknown component {dependency:?}")]
    UnknownDependency {
        component: String,
        dependency: String,
    },
    /// The dependencies form a cycle (a component depending on itself included).
    #[error("dependency cycle: {}", .0.join(" -> "))]
    Cycle(Vec<String>),
    /// The change does not fit the target kind (the CRD's CEL rule prevents this too), or
    /// the target as read.
    #[error("component {component:?}: {message}")]
    InvalidChange { component: String, message: String },
    /// The target kind's own validation refuses the change (a server-side dry run before the
    /// plan starts): an image the API server rejects, a PostgresCluster version out of range
    /// or lower than the current one.
    #[error("component {component:?}: {kind} {name} refuses the change: {message}")]
    ChangeRefused {
        component: String,
        kind: String,
        name: String,
        message: String,
    },
    /// A custom health expression does not compile, exceeds its cost budget or nesting
    /// depth, or its evaluation outlived its time limit (see [`crate::health`]).
    #[error("component {component:?}: health.{field} is refused: {message}")]
    InvalidHealthCheck {
        component: String,
        field: &'static str,
        message: String,
    },
    /// `spec.serviceAccountName` names a ServiceAccount that does not delegate to this plan
    /// ([`DELEGATE_ANNOTATION`]), or does not exist.
    #[error(
        "ServiceAccount {account:?} {why}: to let this plan act as it, annotate it {DELEGATE_ANNOTATION}: \"{plan}\" (plan names, comma-separated, or \"*\" for every plan of the namespace)"
    )]
    NotDelegated {
        account: String,
        plan: String,
        why: &'static str,
    },
    /// The API server refuses a hook's Job (a server-side dry run before the plan starts).
    #[error("component {component:?}: the {stage} hook's Job is refused: {message}")]
    InvalidHook {
        component: String,
        stage: &'static str,
        message: String,
    },
}

impl Invalid {
    /// The CamelCase reason of the `Valid` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Invalid::NoComponents => "NoComponents",
            Invalid::DuplicateName(_) => "DuplicateName",
            Invalid::UnknownDependency { .. } => "UnknownDependency",
            Invalid::Cycle(_) => "DependencyCycle",
            Invalid::InvalidChange { .. } => "InvalidChange",
            Invalid::ChangeRefused { .. } => "ChangeRefused",
            Invalid::InvalidHealthCheck { .. } => "InvalidHealthCheck",
            Invalid::InvalidHook { .. } => "InvalidHook",
            Invalid::NotDelegated { .. } => "ServiceAccountNotDelegated",
        }
    }
}

/// A validated plan: the components' indices, wave by wave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `waves[w]` = indices into `spec.components` of wave `w + 1`, sorted by name.
    pub waves: Vec<Vec<usize>>,
    /// `wave_of[i]` = the 0-based wave of component `i`.
    pub wave_of: Vec<usize>,
}

impl Plan {
    /// The 1-based wave of component `index`.
    pub fn wave_number(&self, index: usize) -> i32 {
        self.wave_of
            .get(index)
            .map_or(0, |w| i32::try_from(*w + 1).unwrap_or(i32::MAX))
    }
}

/// Checks names, dependencies and changes, and layers the components into waves.
///
/// # Errors
/// The first [`Invalid`] found, in this order: no components, duplicate names, invalid
/// changes, unknown dependencies, cycles.
pub fn plan(components: &[Component]) -> Result<Plan, Invalid> {
    if components.is_empty() {
        return Err(Invalid::NoComponents);
    }
    let mut index: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, c) in components.iter().enumerate() {
        if index.insert(c.name.as_str(), i).is_some() {
            return Err(Invalid::DuplicateName(c.name.clone()));
        }
    }
    for c in components {
        check_change(c)?;
    }
    // deps[i] = indices component i depends on (deduplicated).
    let mut deps: Vec<BTreeSet<usize>> = Vec::with_capacity(components.len());
    for c in components {
        let mut set = BTreeSet::new();
        for d in &c.depends_on {
            match index.get(d.as_str()) {
                Some(j) => {
                    set.insert(*j);
                }
                None => {
                    return Err(Invalid::UnknownDependency {
                        component: c.name.clone(),
                        dependency: d.clone(),
                    });
                }
            }
        }
        deps.push(set);
    }

    // Kahn's algorithm by levels: a component's wave is one more than its deepest dependency.
    let n = components.len();
    let mut wave_of: Vec<Option<usize>> = vec![None; n];
    let mut placed = 0;
    let mut level = 0;
    while placed < n {
        let ready: Vec<usize> = (0..n)
            .filter(|&i| wave_of[i].is_none())
            .filter(|&i| {
                deps[i]
                    .iter()
                    .all(|&d| wave_of[d].is_some_and(|w| w < level))
            })
            .collect();
        if ready.is_empty() {
            return Err(Invalid::Cycle(find_cycle(components, &deps, &wave_of)));
        }
        for &i in &ready {
            wave_of[i] = Some(level);
        }
        placed += ready.len();
        level += 1;
    }
    let wave_of: Vec<usize> = wave_of.into_iter().map(|w| w.unwrap_or(0)).collect();
    let mut waves = vec![Vec::new(); level];
    for (i, &w) in wave_of.iter().enumerate() {
        waves[w].push(i);
    }
    for wave in &mut waves {
        wave.sort_by(|&a, &b| components[a].name.cmp(&components[b].name));
    }
    Ok(Plan { waves, wave_of })
}

fn check_change(c: &Component) -> Result<(), Invalid> {
    let err = |message: &str| {
        Err(Invalid::InvalidChange {
            component: c.name.clone(),
            message: message.to_string(),
        })
    };
    let set = c.set.is_some();
    match c.target.typed() {
        _ if set => {
            if c.image.is_some() || c.version.is_some() {
                return err("a component with set sets neither image nor version");
            }
        }
        Some(TargetKind::PostgresCluster) => {
            if c.version.is_none() || c.image.is_some() {
                return err("a PostgresCluster component sets version (and not image)");
            }
        }
        Some(TargetKind::Deployment | TargetKind::StatefulSet | TargetKind::DaemonSet) => {
            if c.image.is_none() || c.version.is_some() {
                return err(
                    "a Deployment, StatefulSet or DaemonSet component sets image (and not version)",
                );
            }
        }
        None => {
            return err(&format!(
                "{} {} is not a built-in kind: the component sets a field with set",
                c.target.api_version.as_deref().unwrap_or("(no apiVersion)"),
                c.target.kind
            ));
        }
    }
    if let Some(check) = &c.health {
        let expressions = [
            ("healthy", Some(&check.healthy)),
            ("failed", check.failed.as_ref()),
        ];
        for (field, expression) in expressions {
            if let Some(Err(message)) = expression.map(|e| crate::health::check(e)) {
                return Err(Invalid::InvalidHealthCheck {
                    component: c.name.clone(),
                    field,
                    message,
                });
            }
        }
    }
    Ok(())
}

/// The annotation by which a ServiceAccount lets plans of its namespace act as it
/// (`spec.serviceAccountName`): their names, comma-separated, or `*` for every plan there. Set
/// by whoever may change the ServiceAccount, so that creating an UpgradePlan does not amount to
/// acting as any ServiceAccount of the namespace.
pub const DELEGATE_ANNOTATION: &str = "upgrade.steward.dev/plans";

/// Whether a ServiceAccount whose [`DELEGATE_ANNOTATION`] is `annotation` lets plan `plan`
/// act as it.
pub fn delegates(annotation: Option<&str>, plan: &str) -> bool {
    annotation.is_some_and(|names| {
        names
            .split(',')
            .map(str::trim)
            .any(|name| name == "*" || name == plan)
    })
}

/// Whether a component's health rule outlived its evaluation's time limit
/// ([`crate::health::too_slow`]): checked before a plan starts (a started plan's rules are
/// not evaluated again, and its component fails at its deadline).
///
/// # Errors
/// [`Invalid::InvalidHealthCheck`] for the first such rule.
pub fn slow_health(components: &[Component]) -> Result<(), Invalid> {
    for c in components {
        let Some(check) = &c.health else { continue };
        let expressions = [
            ("healthy", Some(&check.healthy)),
            ("failed", check.failed.as_ref()),
        ];
        for (field, expression) in expressions {
            if expression.is_some_and(|e| crate::health::too_slow(e)) {
                return Err(Invalid::InvalidHealthCheck {
                    component: c.name.clone(),
                    field,
                    message: format!(
                        "its evaluation took over {}s (the limit)",
                        crate::health::EVALUATION_LIMIT.as_secs_f64()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// One cycle among the components not placed in a wave, as names `a -> b -> a`.
fn find_cycle(
    components: &[Component],
    deps: &[BTreeSet<usize>],
    placed: &[Option<usize>],
) -> Vec<String> {
    // Every unplaced component has an unplaced dependency (or it would have been placed), so
    // walking unplaced dependencies from any unplaced component must revisit one.
    let Some(start) = (0..components.len()).find(|&i| placed[i].is_none()) else {
        return Vec::new();
    };
    let mut path = vec![start];
    let mut current = start;
    while let Some(next) = deps[current].iter().copied().find(|&d| placed[d].is_none()) {
        if let Some(pos) = path.iter().position(|&p| p == next) {
            let mut cycle: Vec<String> = path[pos..]
                .iter()
                .map(|&i| components[i].name.clone())
                .collect();
            cycle.push(components[next].name.clone());
            return cycle;
        }
        path.push(next);
        current = next;
    }
    path.iter().map(|&i| components[i].name.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_account_delegates_to_the_plans_it_names() {
        assert!(delegates(Some("*"), "release"));
        assert!(delegates(Some("nightly, release"), "release"));
        assert!(!delegates(Some("nightly,release-2"), "release"));
        assert!(!delegates(Some(""), "release"));
        assert!(!delegates(None, "release"));
    }
    use crate::crd::{ImageChange, TargetRef};

    fn c(name: &str, deps: &[&str]) -> Component {
        Component {
            name: name.into(),
            target: TargetRef::of(TargetKind::Deployment, name),
            image: Some(ImageChange {
                container: "app".into(),
                image: "img:2".into(),
            }),
            version: None,
            depends_on: deps.iter().map(|d| d.to_string()).collect(),
            rollback: None,
            health: None,
            hooks: None,
            set: None,
        }
    }

    fn names(components: &[Component], plan: &Plan) -> Vec<Vec<String>> {
        plan.waves
            .iter()
            .map(|w| w.iter().map(|&i| components[i].name.clone()).collect())
            .collect()
    }

    #[test]
    fn diamond_has_three_waves() {
        let cs = vec![
            c("web", &["api", "worker"]),
            c("api", &["db"]),
            c("worker", &["db"]),
            c("db", &[]),
        ];
        let p = plan(&cs).unwrap();
        assert_eq!(
            names(&cs, &p),
            vec![vec!["db"], vec!["api", "worker"], vec!["web"]]
        );
        assert_eq!(p.wave_number(0), 3);
        assert_eq!(p.wave_number(3), 1);
    }

    #[test]
    fn wave_is_one_more_than_the_deepest_dependency() {
        // c depends on a (wave 1) and b (wave 2): c goes to wave 3, not 2.
        let cs = vec![c("c", &["a", "b"]), c("b", &["a"]), c("a", &[])];
        let p = plan(&cs).unwrap();
        assert_eq!(names(&cs, &p), vec![vec!["a"], vec!["b"], vec!["c"]]);
    }

    #[test]
    fn independent_components_share_wave_one_sorted_by_name() {
        let cs = vec![c("zeta", &[]), c("alpha", &[]), c("mid", &[])];
        let p = plan(&cs).unwrap();
        assert_eq!(names(&cs, &p), vec![vec!["alpha", "mid", "zeta"]]);
    }

    #[test]
    fn every_dependency_is_in_an_earlier_wave() {
        let cs = vec![
            c("a", &[]),
            c("b", &["a"]),
            c("c", &["a"]),
            c("d", &["b", "c"]),
            c("e", &[]),
            c("f", &["e", "d"]),
            c("g", &["b", "b"]),
        ];
        let p = plan(&cs).unwrap();
        for (i, comp) in cs.iter().enumerate() {
            for d in &comp.depends_on {
                let j = cs.iter().position(|x| &x.name == d).unwrap();
                assert!(
                    p.wave_of[j] < p.wave_of[i],
                    "{d} must precede {}",
                    comp.name
                );
            }
        }
        assert_eq!(p.waves.iter().map(Vec::len).sum::<usize>(), cs.len());
    }

    #[test]
    fn cycle_is_named() {
        let cs = vec![c("a", &["c"]), c("b", &["a"]), c("c", &["b"]), c("d", &[])];
        let err = plan(&cs).unwrap_err();
        let Invalid::Cycle(path) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(path.first(), path.last());
        assert_eq!(path.len(), 4, "{path:?}");
        assert_eq!(err.reason(), "DependencyCycle");
        assert!(err.to_string().starts_with("dependency cycle: "), "{err}");
    }

    #[test]
    fn self_dependency_is_a_cycle() {
        let err = plan(&[c("a", &["a"])]).unwrap_err();
        assert_eq!(err, Invalid::Cycle(vec!["a".into(), "a".into()]));
    }

    #[test]
    fn unknown_dependency_and_duplicates_are_invalid() {
        assert_eq!(
            plan(&[c("a", &["nope"])]).unwrap_err(),
            Invalid::UnknownDependency {
                component: "a".into(),
                dependency: "nope".into()
            }
        );
        assert_eq!(
            plan(&[c("a", &[]), c("a", &[])]).unwrap_err(),
            Invalid::DuplicateName("a".into())
        );
        assert_eq!(plan(&[]).unwrap_err(), Invalid::NoComponents);
    }

    #[test]
    fn change_must_fit_the_kind() {
        let mut pg = c("db", &[]);
        pg.target = TargetRef::of(TargetKind::PostgresCluster, &pg.target.name);
        assert_eq!(
            plan(std::slice::from_ref(&pg)).unwrap_err().reason(),
            "InvalidChange"
        );
        pg.image = None;
        pg.version = Some("17".into());
        assert!(plan(&[pg]).is_ok());
    }

    #[test]
    fn a_health_rule_that_does_not_compile_makes_the_plan_invalid() {
        let mut a = c("a", &[]);
        a.health = Some(crate::crd::HealthCheck {
            healthy: "self.status.ready".into(),
            failed: Some("self.status.(".into()),
        });
        let err = plan(&[a]).unwrap_err();
        assert_eq!(err.reason(), "InvalidHealthCheck");
        assert!(
            err.to_string().contains("health.failed is refused"),
            "{err}"
        );
    }

    #[test]
    fn a_health_rule_over_its_cost_budget_makes_the_plan_invalid() {
        // Issue #39's reproduction: five comprehensions over a literal list of 40 ints.
        let list = format!(
            "[{}]",
            (0..40).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
        );
        let healthy = format!(
            "{list}.all(a, {list}.all(b, {list}.all(c, {list}.all(d, {list}.all(e, a+b+c+d+e >= 0)))))"
        );
        let mut a = c("a", &[]);
        a.health = Some(crate::crd::HealthCheck {
            healthy,
            failed: None,
        });
        let err = plan(&[a, c("b", &["a"])]).unwrap_err();
        assert_eq!(err.reason(), "InvalidHealthCheck", "{err}");
        assert!(err.to_string().contains("health.healthy"), "{err}");
    }
}

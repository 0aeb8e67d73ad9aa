//! Sharding by server (`--shards N`, see `steward_core::shard`): every object that writes to
//! one PostgreSQL server is on that server's shard, so one replica writes for it.
//!
//! ```text
//! PostgresCluster     its own key, namespace/name                    (steward_core::shard::key_of)
//! Database            clusterRef: its cluster's key, namespace/cluster
//!                     external:   its server's key, external:host:port    (every namespace)
//! DatabaseRole        its Database's key
//! children            their owner's shard label (steward-core's Children copies it)
//! ```
//!
//! The key of a Database or a DatabaseRole is in its spec (a DatabaseRole's in its Database's),
//! which steward-core's labeller (`Operator::shard_labels`, metadata only) cannot read: [`label`]
//! labels both kinds on the main leader, from a cache of each; PostgresClusters are labelled by
//! steward-core's.
//!
//! # Guarantees
//! - A cluster, its Databases, their DatabaseRoles and all their children share one shard: one
//!   replica writes to the cluster's server, its objects and their Secrets.
//! - Every Database and DatabaseRole naming one external `host:port` shares one shard, whatever
//!   its namespace or admin Secret: a deleting Database's or DatabaseRole's cleanup ends the
//!   sessions of other operator replicas on its server (`observe::end_stale_sessions`), which is
//!   right only if no other replica works there legitimately.
//! - The keys do not change while an object lives: `clusterRef`, the external `host`, `port`
//!   and admin Secret, and `databaseRef` are immutable (the CRDs' rules). A DatabaseRole whose
//!   Database does not exist yet is labelled with its own key (so it is reconciled and says
//!   what it waits for) and moves to its Database's shard once that exists.
//!
//! # Caveats
//! - One server named two ways (an IP address and a host name, or two names) is two keys,
//!   possibly two shards.
//! - A DatabaseRole created before its Database, then moved, may be reconciled by the two
//!   replicas one right after the other (the move is a relabel; see `steward_core::shard`).

use std::collections::HashMap;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use steward_core::shard::{SHARD_LABEL, key_of};

use crate::crd::{Database, DatabaseRole, ExternalServer};

/// The key of the PostgresCluster `name` in `namespace`: what [`key_of`] gives for it.
pub fn cluster_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The key of an external server: `external:<host>:<port>`, the host in lower case without a
/// trailing dot (DNS names are case-insensitive). No namespace: one server, one shard.
pub fn server_key(server: &ExternalServer) -> String {
    let host = server
        .host
        .trim()
        .trim_end_matches('.')
        .to_ascii_lowercase();
    format!("external:{host}:{}", server.port)
}

/// The key a Database is sharded by: its cluster's, or its external server's. One with
/// neither (refused at admission) is on its own key, to be reconciled and refused.
pub fn database_key(db: &Database) -> String {
    match (&db.spec.cluster_ref, &db.spec.external) {
        (Some(cluster), _) => cluster_key(&db.namespace().unwrap_or_default(), &cluster.name),
        (None, Some(server)) => server_key(server),
        (None, None) => key_of(&db.metadata),
    }
}

/// The key a DatabaseRole is sharded by, given its Database (`None`: it does not exist):
/// that Database's. Without one, a role already labelled keeps its shard (`None`: leave it),
/// and one not labelled yet goes to its own key.
pub fn role_key(role: &DatabaseRole, database: Option<&Database>) -> Option<String> {
    match database {
        Some(db) => Some(database_key(db)),
        None if role.labels().contains_key(SHARD_LABEL) => None,
        None => Some(key_of(&role.metadata)),
    }
}

/// Whether `role` names `db` as its Database.
fn refers_to(role: &DatabaseRole, db: &Database) -> bool {
    role.namespace() == db.namespace() && role.spec.database_ref.name == db.name_any()
}

/// An event of [`label`]'s two watches.
enum Changed {
    Database(Box<Result<watcher::Event<Database>, watcher::Error>>),
    Role(Box<Result<watcher::Event<DatabaseRole>, watcher::Error>>),
}

/// Keeps [`SHARD_LABEL`] right on every Database ([`database_key`]) and DatabaseRole
/// ([`role_key`]) in `namespace` (all namespaces when `None`), over `shards` shards, until
/// `stop` completes. Meant for the main leader (`Operator::singleton`), with its client.
///
/// A DatabaseRole is labelled once the Databases have been listed, from the Database cache or,
/// for one the cache has not seen yet (created a moment ago), from the API server; a new or
/// recreated Database has the DatabaseRoles naming it labelled again.
pub async fn label(
    client: Client,
    namespace: Option<String>,
    shards: u32,
    stop: impl Future<Output = ()> + Send,
) {
    let (databases, roles): (Api<Database>, Api<DatabaseRole>) = match namespace.as_deref() {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let config = watcher::Config::default().any_semantic();
    let (db_store, db_writer) = reflector::store();
    let (role_store, role_writer) = reflector::store();
    let db_events = reflector::reflector(
        db_writer,
        watcher(databases, config.clone()).modify(steward_core::controller::trim),
    )
    .default_backoff()
    .map(|e| Changed::Database(Box::new(e)));
    let role_events = reflector::reflector(
        role_writer,
        watcher(roles, config).modify(steward_core::controller::trim),
    )
    .default_backoff()
    .map(|e| Changed::Role(Box::new(e)));
    let events = futures::stream::select(db_events, role_events).take_until(stop);
    futures::pin_mut!(events);
    let labeller = Labeller {
        client,
        db_store,
        shards,
    };
    // Roles seen before the Databases were listed, and the key of each Database seen.
    let mut listed = false;
    let mut early: Vec<DatabaseRole> = Vec::new();
    let mut keys: HashMap<ObjectRef<Database>, String> = HashMap::new();
    while let Some(event) = events.next().await {
        match event {
            Changed::Database(event) => match *event {
                Ok(watcher::Event::Apply(db) | watcher::Event::InitApply(db)) => {
                    let key = database_key(&db);
                    labeller.relabel(&db, Some(&key)).await;
                    // A new Database (or one recreated with another server): its roles follow.
                    if keys.insert(ObjectRef::from_obj(&db), key.clone()).as_ref() != Some(&key) {
                        for role in role_store.state() {
                            if refers_to(&role, &db) {
                                let key = role_key(&role, Some(&db));
                                labeller.relabel(role.as_ref(), key.as_deref()).await;
                            }
                        }
                    }
                }
                Ok(watcher::Event::Delete(db)) => {
                    keys.remove(&ObjectRef::from_obj(&db));
                }
                Ok(watcher::Event::InitDone) => {
                    listed = true;
                    for role in std::mem::take(&mut early) {
                        labeller.role(&role).await;
                    }
                }
                Ok(watcher::Event::Init) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "database shard labeller: Database watch error")
                }
            },
            Changed::Role(event) => match *event {
                Ok(watcher::Event::Apply(role) | watcher::Event::InitApply(role)) => {
                    if listed {
                        labeller.role(&role).await;
                    } else {
                        early.push(role);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "database shard labeller: DatabaseRole watch error")
                }
            },
        }
    }
}

/// What [`label`] writes with.
struct Labeller {
    client: Client,
    db_store: Store<Database>,
    shards: u32,
}

impl Labeller {
    /// Labels `role` for its Database, read from the cache or, if the cache has not seen it,
    /// from the API server.
    async fn role(&self, role: &DatabaseRole) {
        let ns = role.namespace().unwrap_or_default();
        let name = &role.spec.database_ref.name;
        let database = match self.db_store.get(&ObjectRef::new(name).within(&ns)) {
            Some(db) => Some(db.as_ref().clone()),
            None => Api::<Database>::namespaced(self.client.clone(), &ns)
                .get_opt(name)
                .await
                .unwrap_or_else(|e| {
                    tracing::debug!(database = %name, error = %e, "failed to read a role's Database");
                    None
                }),
        };
        self.relabel(role, role_key(role, database.as_ref()).as_deref())
            .await;
    }

    /// Sets `obj`'s [`SHARD_LABEL`] to the shard of `key` if it is not that already (`None`:
    /// leaves it alone).
    async fn relabel<K>(&self, obj: &K, key: Option<&str>)
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let Some(key) = key else { return };
        steward_core::shard::relabel::<K>(&self.client, obj.meta(), key, self.shards).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{DatabaseRoleSpec, DatabaseSpec, DeletionPolicy, LocalRef, Privileges};
    use steward_core::shard::shard_of;

    fn database(ns: &str, name: &str, spec: DatabaseSpec) -> Database {
        let mut db = Database::new(name, spec);
        db.metadata.namespace = Some(ns.into());
        db
    }

    fn on_cluster(ns: &str, name: &str, cluster: &str) -> Database {
        let mut spec = DatabaseSpec::on(ExternalServer::plain("unused", 1, "unused"), "app", "o");
        spec.external = None;
        spec.cluster_ref = Some(LocalRef {
            name: cluster.into(),
        });
        database(ns, name, spec)
    }

    fn external(ns: &str, name: &str, host: &str, port: u16, secret: &str) -> Database {
        database(
            ns,
            name,
            DatabaseSpec::on(ExternalServer::plain(host, port, secret), "app", "o"),
        )
    }

    fn role(ns: &str, name: &str, db: &str) -> DatabaseRole {
        let mut r = DatabaseRole::new(
            name,
            DatabaseRoleSpec {
                database_ref: LocalRef { name: db.into() },
                role_name: "r".into(),
                privileges: Privileges::ReadOnly,
                password_rotation: None,
                adopt: false,
                deletion_policy: DeletionPolicy::Retain,
            },
        );
        r.metadata.namespace = Some(ns.into());
        r
    }

    fn cluster_meta(
        ns: &str,
        name: &str,
    ) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_database_and_its_roles_follow_their_cluster() {
        let cluster = key_of(&cluster_meta("team-a", "main"));
        assert_eq!(cluster_key("team-a", "main"), cluster);
        let db = on_cluster("team-a", "app", "main");
        assert_eq!(database_key(&db), cluster, "not the Database's own key");
        let r = role("team-a", "reader", "app");
        assert_eq!(role_key(&r, Some(&db)), Some(cluster.clone()));
        for shards in [2, 3, 16] {
            let want = shard_of(&cluster, shards);
            assert_eq!(shard_of(&database_key(&db), shards), want);
            assert_eq!(shard_of(&role_key(&r, Some(&db)).unwrap(), shards), want);
        }
        // On their own keys the Database and the role would land elsewhere: the shards above
        // agree because of the keys, not by chance.
        for own in [key_of(&db.metadata), key_of(&r.metadata)] {
            assert!(
                [2, 3, 5, 7, 16]
                    .iter()
                    .any(|&n| shard_of(&own, n) != shard_of(&cluster, n)),
                "{own}"
            );
        }
        // Another namespace's cluster of the same name is another key.
        assert_ne!(database_key(&on_cluster("team-b", "app", "main")), cluster);
    }

    #[test]
    fn external_databases_and_their_roles_follow_their_server() {
        let a = external("team-a", "one", "db.example.com", 5432, "admin");
        // Another namespace, another admin Secret, the host spelled otherwise: one server.
        let b = external("team-b", "two", "DB.example.com.", 5432, "other-admin");
        assert_eq!(database_key(&a), "external:db.example.com:5432");
        assert_eq!(database_key(&a), database_key(&b));
        assert_ne!(
            database_key(&a),
            database_key(&external("team-a", "one", "db.example.com", 5433, "admin")),
            "another port is another server"
        );
        let r = role("team-b", "reader", "two");
        assert_eq!(role_key(&r, Some(&b)), Some(database_key(&a)));
        // No server named ns/name can collide with a cluster's key.
        assert!(!database_key(&a).contains('/'));
    }

    #[test]
    fn a_role_without_its_database_keeps_its_shard_or_takes_its_own() {
        let mut r = role("team-a", "reader", "missing");
        assert_eq!(role_key(&r, None), Some("team-a/reader".to_string()));
        r.labels_mut().insert(SHARD_LABEL.into(), "1".into());
        assert_eq!(
            role_key(&r, None),
            None,
            "a labelled role stays where it is"
        );
        let db = on_cluster("team-a", "missing", "main");
        assert_eq!(role_key(&r, Some(&db)), Some("team-a/main".to_string()));
    }

    #[test]
    fn a_database_without_a_server_is_on_its_own_key() {
        let mut db = on_cluster("team-a", "odd", "main");
        db.spec.cluster_ref = None;
        assert_eq!(database_key(&db), "team-a/odd");
    }

    #[test]
    fn a_role_refers_to_its_database_in_its_namespace_only() {
        let db = on_cluster("team-a", "app", "main");
        assert!(refers_to(&role("team-a", "r", "app"), &db));
        assert!(!refers_to(&role("team-b", "r", "app"), &db));
        assert!(!refers_to(&role("team-a", "r", "other"), &db));
    }
}

//! A real PgBouncer (testenv's build of the pinned release) configured by [`config::render`]
//! in front of a real PostgreSQL (testenv's): SCRAM logins through the lookup function, the
//! superuser refused, `RELOAD` moving the server, `PAUSE` waiting for an open transaction,
//! clients waiting while paused, `RESUME`, the metrics scraped from `SHOW POOLS` and `SHOW
//! STATS`, and the safe shutdown.
//!
//! Skipped (with a message saying why) only when PgBouncer cannot be built or PostgreSQL is
//! not installed.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use steward_pooler::admin::{self, Console, Login};
use steward_pooler::config::{self, PoolMode, Target};
use steward_pooler::metrics::{Counters, Metrics};
use steward_pooler::pgbouncer::{self, Process};
use support::{APP_PASSWORD, AUTH_PASSWORD, connect, give_to_pgbouncer, one_value, wait_for};

const ADMIN_PASSWORD: &str = "agent-secret";

#[tokio::test]
async fn pgbouncer_pools_scram_logins_and_pauses_for_open_transactions() {
    let Some((program, pg, superuser)) = support::prerequisites().await else {
        return;
    };
    let started = Instant::now();

    let dir = tempfile::Builder::new()
        .prefix("steward-pooler-")
        .tempdir()
        .expect("temp dir");
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).expect("run dir");
    let port = steward_testenv::free_port().expect("a free port");
    let settings = config::Settings {
        listen_addr: "127.0.0.1".into(),
        listen_port: port,
        server_port: pg.port(),
        run_dir: run_dir.clone(),
        pool_mode: PoolMode::Transaction,
        default_pool_size: 5,
        max_client_conn: 50,
        tls: None,
    };
    // First somewhere nothing listens: only the RELOAD below makes logins work.
    let nowhere = Target::Pod {
        name: "pg-9".into(),
        ip: "127.0.0.2".into(),
    };
    pgbouncer::write_file(
        &settings.ini_path(),
        &config::render(&settings, &nowhere),
        0o644,
    )
    .expect("ini");
    pgbouncer::write_file(
        &settings.auth_file_path(),
        &config::auth_file(AUTH_PASSWORD, ADMIN_PASSWORD).expect("auth file"),
        0o600,
    )
    .expect("auth file");
    for path in [&run_dir, &settings.ini_path(), &settings.auth_file_path()] {
        give_to_pgbouncer(path);
    }
    let command = support::pgbouncer_command(&program, &settings.ini_path());
    let mut process = Process::start(command).expect("PgBouncer starts");
    let login = Login {
        socket_dir: run_dir.clone(),
        port,
        password: ADMIN_PASSWORD.into(),
    };
    let console = wait_for(
        "the admin console answers",
        Duration::from_secs(10),
        || async {
            let console = Console::connect(&login).await.ok()?;
            console
                .show("SHOW VERSION", Duration::from_secs(2))
                .await
                .ok()?;
            Some(console)
        },
    )
    .await;
    let wrong = Login {
        password: "guess".into(),
        ..login.clone()
    };
    assert!(
        Console::connect(&wrong).await.is_err(),
        "the console takes only the agent's password"
    );

    // RELOAD moves every database to the primary.
    let primary = Target::Pod {
        name: "pg-0".into(),
        ip: "127.0.0.1".into(),
    };
    pgbouncer::write_file(
        &settings.ini_path(),
        &config::render(&settings, &primary),
        0o644,
    )
    .expect("ini");
    console
        .command("RELOAD", Duration::from_secs(5))
        .await
        .expect("RELOAD");

    // SCRAM end to end: the client to PgBouncer, PgBouncer to PostgreSQL with the client's keys.
    let app = connect(port, "app", APP_PASSWORD)
        .await
        .expect("app logs in through PgBouncer");
    assert_eq!(one_value(&app, "SELECT current_user").await, "app");
    assert!(
        one_value(
            &superuser,
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'app'"
        )
        .await
        .starts_with("SCRAM-SHA-256$"),
        "PostgreSQL keeps a SCRAM verifier"
    );
    assert!(
        connect(port, "app", "wrong").await.is_err(),
        "a wrong password is refused"
    );
    let refused = connect(port, "postgres", pg.password()).await;
    assert!(
        refused.is_err(),
        "the superuser must not log in through PgBouncer"
    );
    assert!(
        connect(port, "steward_agent", ADMIN_PASSWORD)
            .await
            .is_err(),
        "the agent's password opens the admin console only"
    );

    // PAUSE waits for the open transaction's COMMIT.
    app.batch_execute("BEGIN; SELECT 1").await.expect("BEGIN");
    let pausing = tokio::spawn({
        let login = login.clone();
        async move {
            let session = Console::connect(&login).await?;
            session.command("PAUSE", Duration::from_secs(10)).await
        }
    });
    wait_for(
        "PgBouncer in pause mode",
        Duration::from_secs(5),
        || async {
            let state = console
                .show("SHOW STATE", Duration::from_secs(2))
                .await
                .ok()?;
            state
                .rows
                .iter()
                .any(|r| r[0].as_deref() == Some("paused") && r[1].as_deref() == Some("yes"))
                .then_some(())
        },
    )
    .await;
    // Pause mode is on; PAUSE itself must not return while the transaction is open. A second
    // is several of PgBouncer's janitor rounds, in which a PAUSE not waiting would return.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !pausing.is_finished(),
        "PAUSE returned with a transaction open"
    );
    app.batch_execute("COMMIT").await.expect("COMMIT");
    tokio::time::timeout(Duration::from_secs(5), pausing)
        .await
        .expect("PAUSE returns once the transaction committed")
        .expect("the PAUSE task")
        .expect("PAUSE");

    // Paused: the next transaction waits in PgBouncer (seen as a waiting client).
    let waiting = tokio::spawn(async move {
        let value = one_value(&app, "SELECT 2").await;
        (app, value)
    });
    let metrics = Metrics::new(login.clone(), Arc::new(Counters::default()));
    let text = wait_for(
        "a client waiting in SHOW POOLS",
        Duration::from_secs(5),
        || async {
            let pools = admin::pools(
                &console
                    .show("SHOW POOLS", Duration::from_secs(2))
                    .await
                    .ok()?,
            )
            .ok()?;
            let pool = pools
                .iter()
                .find(|p| p.database == "postgres" && p.user == "app")?;
            if pool.cl_waiting < 1.0 {
                return None;
            }
            let text = metrics.render().await;
            text.contains(r#"steward_pgbouncer_clients_waiting{database="postgres",user="app"} 1"#)
                .then_some(text)
        },
    )
    .await;
    for line in [
        "steward_pooler_up 1",
        r#"steward_pgbouncer_servers_active{database="postgres",user="app"} 0"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
    assert!(!waiting.is_finished(), "a query ran while paused");
    console
        .command("RESUME", Duration::from_secs(5))
        .await
        .expect("RESUME");
    let (app, value) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting query runs after RESUME")
        .expect("the query task");
    assert_eq!(value, "2");
    let resumed = console.command("RESUME", Duration::from_secs(5)).await;
    assert_eq!(
        resumed.as_ref().err().and_then(admin::Error::message),
        Some("pooler is not paused/suspended"),
        "the agent counts this message as already resumed: {resumed:?}"
    );

    // SHOW STATS: the app's transactions, counted per database.
    let stats = admin::stats(
        &console
            .show("SHOW STATS", Duration::from_secs(2))
            .await
            .expect("SHOW STATS"),
    )
    .expect("SHOW STATS rows");
    let postgres = stats
        .iter()
        .find(|s| s.database == "postgres")
        .expect("stats of the database postgres");
    assert!(postgres.transactions >= 3.0, "{postgres:?}");
    assert!(postgres.queries >= postgres.transactions, "{postgres:?}");

    // Safe shutdown: the idle client does not hold it up.
    drop(console);
    let stopping = Instant::now();
    let status = process
        .stop(Duration::from_secs(10))
        .await
        .expect("PgBouncer stops");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "SIGINT waits for servers, not clients (took {:?}, {status})",
        stopping.elapsed()
    );
    drop(app);
    eprintln!("took {:?}", started.elapsed());
}

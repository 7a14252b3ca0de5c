//! The migrator: `flatnet-operator migrate backup|restore|migrate|clean`.
//!
//! It moves rancher-flat-network's "Macvlan V1" objects
//! (`macvlan.cluster.cattle.io/v1` MacvlanSubnet in `kube-system`, the
//! `macvlan.pandaria.cattle.io/*` and `macvlan.panda.io/*` pod template
//! annotations, `<name>-macvlan` Services) to the `flatnetwork.pandaria.io`
//! API. docs/upgrade.md describes the procedure.

pub mod backup;
pub mod convert;
pub mod kinds;
pub mod migration;
pub mod v1;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

/// One-off commands of the operator binary.
#[derive(Subcommand, Debug, Clone)]
pub enum OperatorCommand {
    /// Move rancher-flat-network V1 (macvlan.cluster.cattle.io) objects to flatnet.
    #[command(subcommand)]
    Migrate(MigrateCommand),
}

/// The migrator's steps, in the order they are meant to run.
#[derive(Subcommand, Debug, Clone)]
pub enum MigrateCommand {
    /// Save the V1 objects, V1 Services, workloads with V1 annotations and
    /// V2 subnets as one JSON file per object.
    Backup {
        /// Directory to write; must not exist or be empty.
        #[arg(long, short = 'o', default_value = "flatnet-backup")]
        dir: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// Create the objects of a backup that do not exist (existing ones are left alone).
    Restore {
        /// Directory written by `backup`, or a file the original migrator's
        /// `backup -o FILE` wrote (multi-document YAML).
        #[arg(long, short = 'f', default_value = "flatnet-backup")]
        dir: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// Convert V1 subnets, rewrite workload annotations and create flat-network Services.
    Migrate {
        /// Workload kinds whose pod templates are rewritten.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "deployment,statefulset,daemonset,replicaset,job,cronjob"
        )]
        workload: Vec<WorkloadKind>,
        /// Do not create `<name>-flat-network` Services for V1 `<name>-macvlan` Services.
        #[arg(long)]
        skip_services: bool,
        /// The original migrator's switch: `--migrate-service=false` is `--skip-services`.
        #[arg(long, action = clap::ArgAction::Set, default_value_t = true)]
        migrate_service: bool,
        /// Go on although some V1 values cannot be carried exactly (they are listed).
        #[arg(long)]
        accept_losses: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Delete the V1 subnets and CRDs, once the migration is verified.
    Clean {
        #[command(flatten)]
        common: Common,
    },
}

/// Options of every step.
#[derive(Args, Debug, Clone)]
pub struct Common {
    /// Print what would change; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Kubeconfig context to use (the original migrator's `--context`).
    #[arg(long)]
    pub context: Option<String>,
    /// Accepted for the original migrator's scripts: flatnet never prompts
    /// (use `--dry-run` to see what a step would do).
    #[arg(long, short = 'y')]
    pub yes: bool,
}

impl Common {
    fn context(&self) -> Option<String> {
        self.context.clone().filter(|c| !c.is_empty())
    }
}

/// Workload kinds `migrate` rewrites.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// apps/v1 Deployment.
    Deployment,
    /// apps/v1 StatefulSet.
    Statefulset,
    /// apps/v1 DaemonSet.
    Daemonset,
    /// apps/v1 ReplicaSet (not owned by a Deployment).
    Replicaset,
    /// batch/v1 Job (reported only: its template is immutable).
    Job,
    /// batch/v1 CronJob.
    Cronjob,
}

impl WorkloadKind {
    fn kind(self) -> kinds::Kind {
        match self {
            Self::Deployment => kinds::DEPLOYMENT,
            Self::Statefulset => kinds::STATEFUL_SET,
            Self::Daemonset => kinds::DAEMON_SET,
            Self::Replicaset => kinds::REPLICA_SET,
            Self::Job => kinds::JOB,
            Self::Cronjob => kinds::CRON_JOB,
        }
    }
}

/// Why a step failed; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// No client configuration.
    #[error("cannot configure the Kubernetes client ({0}); set KUBECONFIG or --kubeconfig")]
    Config(String),
    /// An API call failed.
    #[error("cannot {action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// The error.
        #[source]
        source: kube::Error,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// An object or file is not what it should be.
    #[error("cannot decode {what}: {source}")]
    Decode {
        /// The object or file.
        what: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// The backup directory already holds files.
    #[error("{0} is not empty; choose another --dir or move the old backup away")]
    BackupExists(PathBuf),
    /// A backup file of a kind the migrator does not restore.
    #[error("{path}: {api_version} {kind} is not a kind of flatnet backups; remove the file")]
    UnknownKind {
        /// The file.
        path: PathBuf,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
    },
    /// Some V1 values cannot be carried exactly.
    #[error(
        "{0} V1 value(s) cannot be carried exactly (listed above); fix them, or run again with --accept-losses"
    )]
    Losses(usize),
    /// V2 subnets exist with other specs.
    #[error("{0} FlatNetworkSubnet(s) exist with a spec other than the conversion (listed above)")]
    Conflicts(usize),
    /// `clean` found the migration incomplete.
    #[error("the migration is not verified ({0} reason(s) above); nothing was deleted")]
    NotVerified(usize),
}

/// Runs one command against the cluster of `kubeconfig` (or the
/// environment's), with `attachment` as the flat network's
/// NetworkAttachmentDefinition.
pub async fn run(
    command: OperatorCommand,
    kubeconfig: Option<PathBuf>,
    attachment: String,
) -> Result<(), MigrateError> {
    let OperatorCommand::Migrate(step) = command;
    let context = match &step {
        MigrateCommand::Backup { common, .. }
        | MigrateCommand::Restore { common, .. }
        | MigrateCommand::Migrate { common, .. }
        | MigrateCommand::Clean { common } => common.context(),
    };
    let client = client(kubeconfig, context).await?;
    match step {
        MigrateCommand::Backup { dir, common } => {
            let count = backup::backup(&client, &dir, common.dry_run).await?;
            println!("{count} object(s) in the backup {}", dir.display());
        }
        MigrateCommand::Restore { dir, common } => {
            let created = backup::restore(&client, &dir, common.dry_run).await?;
            println!("{created} object(s) created from {}", dir.display());
        }
        MigrateCommand::Migrate {
            workload,
            skip_services,
            migrate_service,
            accept_losses,
            common,
        } => {
            let options = migration::Options {
                attachment,
                workloads: workload.into_iter().map(WorkloadKind::kind).collect(),
                services: !skip_services && migrate_service,
                accept_losses,
                dry_run: common.dry_run,
            };
            migration::migrate(&client, &options).await?;
        }
        MigrateCommand::Clean { common } => migration::clean(&client, common.dry_run).await?,
    }
    Ok(())
}

async fn client(
    kubeconfig: Option<PathBuf>,
    context: Option<String>,
) -> Result<kube::Client, MigrateError> {
    let options = kube::config::KubeConfigOptions {
        context,
        ..Default::default()
    };
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(&path)
                .map_err(|e| MigrateError::Config(format!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(|e| MigrateError::Config(e.to_string()))?
        }
        None if options.context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| MigrateError::Config(e.to_string()))?,
        None => kube::Config::infer()
            .await
            .map_err(|e| MigrateError::Config(e.to_string()))?,
    };
    kube::Client::try_from(config).map_err(|source| MigrateError::Kube {
        action: "create the client".into(),
        source,
    })
}

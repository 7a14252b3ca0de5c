//! The programs a run executes in the VM: where they come from, how they are
//! staged in the run share and the script `/init` runs them with.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};

use super::initramfs::{GUEST_RUN_DIR, PLAN_FILE};
use super::ldd;
use super::workspace::{Workspace, cargo};

/// Separates programs on the command line: `-- a --x , b`.
const PROGRAM_SEPARATOR: &str = ",";

/// One program to run in the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// How reports name it: name and arguments.
    pub label: String,
    /// The executable on the host.
    pub path: PathBuf,
    pub args: Vec<String>,
    /// Working directory; inside the workspace, which the VM sees at the same path.
    pub cwd: PathBuf,
    /// Environment variables for this program only.
    pub env: Vec<(String, String)>,
}

impl Program {
    fn new(
        name: &str,
        path: PathBuf,
        args: Vec<String>,
        cwd: PathBuf,
        env: Vec<(String, String)>,
    ) -> Self {
        let mut label = name.to_string();
        for arg in &args {
            label.push(' ');
            label.push_str(arg);
        }
        Self {
            label,
            path,
            args,
            cwd,
            env,
        }
    }
}

/// Parses `--env KEY=VALUE` options.
pub fn parse_env(options: &[String]) -> Result<Vec<(String, String)>> {
    options
        .iter()
        .map(|option| {
            let (key, value) = option
                .split_once('=')
                .with_context(|| format!("--env {option}: expected KEY=VALUE"))?;
            let valid = key.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            ensure!(valid, "--env {option}: `{key}` is not a variable name");
            Ok((key.to_string(), value.to_string()))
        })
        .collect()
}

/// Parses the programs after `--`: `PROGRAM [ARGS...]`, separated by a lone `,`.
pub fn parse_programs(words: &[String], workspace: &Workspace) -> Result<Vec<Program>> {
    if words.is_empty() {
        return Ok(Vec::new());
    }
    // Programs run where the command was started, like on the host, if the
    // VM can see that directory.
    let here = std::env::current_dir()?;
    let cwd = if here.starts_with(&workspace.root) {
        here
    } else {
        workspace.root.clone()
    };
    words
        .split(|word| word == PROGRAM_SEPARATOR)
        .map(|group| {
            let (program, args) = group.split_first().with_context(|| {
                format!("an empty program around `{PROGRAM_SEPARATOR}` after `--`")
            })?;
            let path = std::fs::canonicalize(program)
                .with_context(|| format!("program `{program}` not found"))?;
            Ok(Program::new(
                program,
                path,
                args.to_vec(),
                cwd.clone(),
                Vec::new(),
            ))
        })
        .collect()
}

/// Builds each `PACKAGE:TEST` integration test with `cargo test --no-run` and
/// returns its executable, run from the package directory like `cargo test` does.
pub fn build_cargo_tests(
    specs: &[String],
    test_args: Option<&str>,
    workspace: &Workspace,
) -> Result<Vec<Program>> {
    let args: Vec<String> = test_args
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    specs
        .iter()
        .map(|spec| {
            let (package, test) = spec.split_once(':').with_context(|| {
                format!("--cargo-test {spec}: expected PACKAGE:TEST, e.g. flatnet-agent:vm_kernel_features")
            })?;
            let built = build_test(package, test, workspace)?;
            let cwd = built
                .manifest_path
                .parent()
                .context("manifest path without directory")?
                .to_path_buf();
            let env = vec![
                ("CARGO_MANIFEST_DIR".to_string(), cwd.display().to_string()),
                ("CARGO_PKG_NAME".to_string(), package.to_string()),
            ];
            Ok(Program::new(spec, built.executable, args.clone(), cwd, env))
        })
        .collect()
}

/// What `cargo test --no-run` reports for a built test target.
struct BuiltTest {
    executable: PathBuf,
    manifest_path: PathBuf,
}

fn build_test(package: &str, test: &str, workspace: &Workspace) -> Result<BuiltTest> {
    let mut child = Command::new(cargo())
        .args([
            "test",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .args(["--package", package, "--test", test])
        .current_dir(&workspace.root)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start cargo")?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut built = None;
    for line in BufReader::new(stdout).lines() {
        let message: serde_json::Value = match serde_json::from_str(&line?) {
            Ok(message) => message,
            Err(_) => continue,
        };
        built = built.or_else(|| test_artifact(&message, test));
    }
    let status = child.wait()?;
    ensure!(
        status.success(),
        "cargo could not build test `{test}` of `{package}`"
    );
    built.with_context(|| format!("cargo built no executable for test `{test}` of `{package}`"))
}

/// The executable of integration test `test` if `message` reports it.
fn test_artifact(message: &serde_json::Value, test: &str) -> Option<BuiltTest> {
    let target = &message["target"];
    let is_test = target["kind"]
        .as_array()
        .is_some_and(|kinds| kinds.iter().any(|kind| kind == "test"));
    if message["reason"] != "compiler-artifact" || target["name"] != test || !is_test {
        return None;
    }
    Some(BuiltTest {
        executable: PathBuf::from(message["executable"].as_str()?),
        manifest_path: PathBuf::from(message["manifest_path"].as_str()?),
    })
}

/// Prepares a fresh run share under the cache: copies of the programs, the
/// shared libraries they load, the plan, and an empty results directory.
pub fn stage(cache: &Path, programs: &[Program], env: &[(String, String)]) -> Result<PathBuf> {
    let run_dir = cache.join(format!("run-{}", std::process::id()));
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir)?;
    }
    for dir in ["bin", "lib", "results"] {
        std::fs::create_dir_all(run_dir.join(dir))?;
    }
    // Copies, not the originals: programs may live outside the shared
    // workspace, and a rebuild during the run must not change them.
    let mut libraries = BTreeSet::new();
    for (index, program) in programs.iter().enumerate() {
        std::fs::copy(&program.path, run_dir.join(guest_file_name(index, program)))
            .with_context(|| format!("cannot copy {}", program.path.display()))?;
        libraries.extend(ldd::shared_libraries(&program.path)?);
    }
    // The VM's loader finds these through LD_LIBRARY_PATH; they are the
    // host's, so host-built programs find the versions they were linked with.
    for library in libraries {
        let name = library.file_name().context("library without file name")?;
        std::fs::copy(&library, run_dir.join("lib").join(name))
            .with_context(|| format!("cannot copy {}", library.display()))?;
    }
    std::fs::write(run_dir.join(PLAN_FILE), plan_script(programs, env))?;
    Ok(run_dir)
}

/// The program's copy in the run share, relative to it.
fn guest_file_name(index: usize, program: &Program) -> String {
    let name = program
        .path
        .file_name()
        .unwrap_or_default()
        .to_string_lossy();
    format!("bin/{index}-{name}")
}

/// The shell script that runs each program and writes `results/<index>.status`.
fn plan_script(programs: &[Program], env: &[(String, String)]) -> String {
    let mut script = String::from(
        "# Generated by `cargo xtask vm-test`: runs each program and records its exit status.\n",
    );
    script.push_str(&format!(
        "export HOME=/root RUST_BACKTRACE=1 LD_LIBRARY_PATH={GUEST_RUN_DIR}/lib\n"
    ));
    // Also where the loader looks by default, for programs the tests start
    // with a cleared environment (the CNI plugin is run that way).
    script.push_str(&format!(
        "mkdir -p /lib/x86_64-linux-gnu && cp {GUEST_RUN_DIR}/lib/* /lib/x86_64-linux-gnu/\n"
    ));
    for (key, value) in env {
        script.push_str(&format!("export {}\n", quote(&format!("{key}={value}"))));
    }
    for (index, program) in programs.iter().enumerate() {
        let header = format!(
            "flatnet-vm: [{}/{}] {}",
            index + 1,
            programs.len(),
            program.label
        );
        script.push_str(&format!("echo {}\n", quote(&header)));
        let mut command = format!("cd {} &&", quote(&program.cwd.to_string_lossy()));
        for (key, value) in &program.env {
            command.push_str(&format!(" export {} &&", quote(&format!("{key}={value}"))));
        }
        command.push_str(&format!(
            " exec {}",
            quote(&format!(
                "{GUEST_RUN_DIR}/{}",
                guest_file_name(index, program)
            ))
        ));
        for arg in &program.args {
            command.push(' ');
            command.push_str(&quote(arg));
        }
        script.push_str(&format!("({command})\n"));
        script.push_str(&format!(
            "echo $? > {GUEST_RUN_DIR}/results/{index}.status\n"
        ));
    }
    script
}

/// Quotes a word for the POSIX shell.
fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// Each program's exit status, or `None` if it never finished.
pub fn read_statuses(run_dir: &Path, count: usize) -> Result<Vec<Option<i32>>> {
    (0..count)
        .map(|index| {
            let file = run_dir.join("results").join(format!("{index}.status"));
            match std::fs::read_to_string(&file) {
                Ok(text) => text
                    .trim()
                    .parse()
                    .map(Some)
                    .with_context(|| format!("{} holds no exit status", file.display())),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(error) => Err(error).with_context(|| format!("cannot read {}", file.display())),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace() -> Workspace {
        Workspace {
            root: PathBuf::from("/"),
            target_dir: PathBuf::from("/target"),
        }
    }

    fn words(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn programs_are_split_at_lone_commas() {
        let programs = parse_programs(
            &words("/bin/true --a x , /bin/false , /bin/sh -c ,x"),
            &workspace(),
        )
        .unwrap();
        let labels: Vec<&str> = programs.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, ["/bin/true --a x", "/bin/false", "/bin/sh -c ,x"]);
        assert_eq!(programs[2].args, ["-c", ",x"]);
    }

    #[test]
    fn an_empty_program_is_an_error() {
        assert!(parse_programs(&words("/bin/true , , /bin/false"), &workspace()).is_err());
        assert!(parse_programs(&words("/bin/true ,"), &workspace()).is_err());
    }

    #[test]
    fn a_missing_program_is_named() {
        let error = parse_programs(&words("/no/such/test"), &workspace()).unwrap_err();
        assert!(error.to_string().contains("/no/such/test"), "{error}");
    }

    #[test]
    fn env_options_need_a_valid_name() {
        assert_eq!(
            parse_env(&words("RUST_LOG=debug A=b=c")).unwrap(),
            [
                ("RUST_LOG".into(), "debug".into()),
                ("A".into(), "b=c".into())
            ]
        );
        assert!(parse_env(&words("NOVALUE")).is_err());
        assert!(parse_env(&words("1X=y")).is_err());
    }

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn the_plan_runs_each_program_in_its_directory_and_records_its_status() {
        let program = Program::new(
            "vm_check",
            PathBuf::from("/ws/target/debug/deps/vm_check-1234"),
            words("--test-threads=1 ipvlan"),
            PathBuf::from("/ws/flatnet-agent"),
            vec![("CARGO_MANIFEST_DIR".into(), "/ws/flatnet-agent".into())],
        );
        let script = plan_script(&[program], &[("RUST_LOG".into(), "debug".into())]);
        assert!(script.contains("export 'RUST_LOG=debug'\n"), "{script}");
        assert!(
            script.contains(
                "(cd '/ws/flatnet-agent' && export 'CARGO_MANIFEST_DIR=/ws/flatnet-agent' && \
                 exec '/run/flatnet/bin/0-vm_check-1234' '--test-threads=1' 'ipvlan')\n\
                 echo $? > /run/flatnet/results/0.status\n"
            ),
            "{script}"
        );
    }

    #[test]
    fn statuses_of_unfinished_programs_are_none() {
        let dir = std::env::temp_dir().join(format!("xtask-statuses-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("results")).unwrap();
        std::fs::write(dir.join("results/0.status"), "0\n").unwrap();
        std::fs::write(dir.join("results/1.status"), "101\n").unwrap();
        let statuses = read_statuses(&dir, 3);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(statuses.unwrap(), [Some(0), Some(101), None]);
    }

    #[test]
    fn only_integration_test_artifacts_match() {
        let message = serde_json::json!({
            "reason": "compiler-artifact",
            "target": {"name": "vm_kernel_features", "kind": ["test"]},
            "executable": "/t/debug/deps/vm_kernel_features-ab",
            "manifest_path": "/ws/flatnet-agent/Cargo.toml",
        });
        let built = test_artifact(&message, "vm_kernel_features").unwrap();
        assert_eq!(
            built.executable,
            PathBuf::from("/t/debug/deps/vm_kernel_features-ab")
        );
        assert!(test_artifact(&message, "other").is_none());
        let mut library = message.clone();
        library["target"]["kind"] = serde_json::json!(["lib"]);
        assert!(test_artifact(&library, "vm_kernel_features").is_none());
    }
}

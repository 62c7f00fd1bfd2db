//! `dflash-host plugins new NAME --kind K [--out DIR]`: write a plugin crate from a template.
//!
//! The templates are complete out-of-tree crates that depend on plugin-api alone, kept buildable
//! in this repository (`plugin-template/` for optimizers, `templates/` for the other kinds) and
//! embedded here; the copy gets the crate's and the plugin's name, and a path to this checkout's
//! plugin-api.

use anyhow::{bail, Context, Result};
use std::{path::PathBuf, process::ExitCode};

#[derive(clap::Args)]
pub struct NewArgs {
    /// The crate's and the plugin's name (`[optimizer] plugin = "NAME"`): lowercase letters,
    /// digits and `_`, starting with a letter.
    name: String,
    /// optimizer | drafter | target | data
    #[arg(long)]
    kind: String,
    /// The folder to write (default: ./NAME); it must not exist or be empty.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The plugin-api crate to depend on (default: this checkout's).
    #[arg(long)]
    plugin_api: Option<PathBuf>,
}

/// A template: its files, and the crate and plugin names to replace.
struct Template {
    cargo_toml: &'static str,
    lib_rs: &'static str,
    crate_name: &'static str,
    plugin_name: &'static str,
}

fn template(kind: &str) -> Result<Template> {
    Ok(match kind {
        "optimizer" => Template {
            cargo_toml: include_str!("../../../plugin-template/Cargo.toml"),
            lib_rs: include_str!("../../../plugin-template/src/lib.rs"),
            crate_name: "optim_sgd",
            plugin_name: "sgd",
        },
        "data" => Template {
            cargo_toml: include_str!("../../../templates/data_ids/Cargo.toml"),
            lib_rs: include_str!("../../../templates/data_ids/src/lib.rs"),
            crate_name: "data_ids",
            plugin_name: "ids",
        },
        "drafter" => Template {
            cargo_toml: include_str!("../../../templates/drafter_tiny/Cargo.toml"),
            lib_rs: include_str!("../../../templates/drafter_tiny/src/lib.rs"),
            crate_name: "drafter_tiny",
            plugin_name: "tiny_drafter",
        },
        "target" => Template {
            cargo_toml: include_str!("../../../templates/target_tiny/Cargo.toml"),
            lib_rs: include_str!("../../../templates/target_tiny/src/lib.rs"),
            crate_name: "target_tiny",
            plugin_name: "tiny_lm",
        },
        k => bail!("--kind {k}: expected optimizer, data, drafter or target"),
    })
}

/// The line of a template that names its plugin (`PluginInfo::new(PLUGIN_NAME, ..)` reads it).
fn plugin_name_line(name: &str) -> String {
    format!("const PLUGIN_NAME: &str = \"{name}\";")
}

pub fn run(args: NewArgs) -> Result<ExitCode> {
    let name = &args.name;
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid {
        bail!("plugin name `{name}`: use lowercase letters, digits and `_`, starting with a letter");
    }
    let t = template(&args.kind)?;
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(name));
    if out.exists() && std::fs::read_dir(&out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("--out {}: exists and is not an empty folder", out.display());
    }
    let api = match &args.plugin_api {
        Some(p) => p.clone(),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../plugin-api")),
    };
    let api =
        api.canonicalize().with_context(|| format!("plugin-api at {} (give --plugin-api PATH)", api.display()))?;
    let rename = |text: &str| {
        text.replace(t.crate_name, name)
            .replace(&plugin_name_line(t.plugin_name), &plugin_name_line(name))
            .replace(&format!("plugin = \"{}\"", t.plugin_name), &format!("plugin = \"{name}\""))
    };
    if !t.lib_rs.contains(&plugin_name_line(t.plugin_name)) {
        bail!("the {} template does not declare `{}`", args.kind, plugin_name_line(t.plugin_name));
    }
    let cargo_toml = rename(t.cargo_toml);
    let Some(dep) = cargo_toml.lines().find(|l| l.starts_with("plugin-api = ")) else {
        bail!("template without a plugin-api dependency")
    };
    let cargo_toml = cargo_toml.replace(dep, &format!("plugin-api = {{ path = {:?} }}", api.display().to_string()));
    std::fs::create_dir_all(out.join("src")).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("Cargo.toml"), cargo_toml)
        .with_context(|| format!("writing {}", out.join("Cargo.toml").display()))?;
    std::fs::write(out.join("src/lib.rs"), rename(t.lib_rs))
        .with_context(|| format!("writing {}", out.join("src/lib.rs").display()))?;
    std::fs::write(out.join(".gitignore"), "target/\nCargo.lock\n")?;
    crate::say!("wrote a {} plugin `{name}` to {}", args.kind, out.display());
    crate::say!(
        "next: (cd {} && cargo build --release), then dflash-host plugins check {}/target/release/lib{name}.so",
        out.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

//! `dflash-host plugins new NAME --kind K [--out DIR]`: write a plugin crate from a template.
//!
//! The templates are complete out-of-tree crates that depend on plugin-api alone, kept buildable
//! in this repository (`plugin-template/` for optimizers, `templates/` for the other kinds) and
//! embedded here; the copy gets the crate's and the plugin's name, and a path to this checkout's
//! plugin-api.
//!
//! So that the printed build line works as printed and compiles the plugin's own crate only,
//! the copy also gets this build's `Cargo.lock` (the same tch, torch-sys and abi_stable versions)
//! and a `.cargo/config.toml` naming the libtorch this host runs on (`LIBTORCH`, which torch-sys's
//! build needs) and, when the host runs from a cargo target folder, that folder: its compiled
//! tch and torch-sys (the same versions, profile and libtorch) are reused.

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
    /// The fields `plugins check` needs besides the defaults, in the printed line.
    check_section: Option<&'static str>,
}

fn template(kind: &str) -> Result<Template> {
    Ok(match kind {
        "optimizer" => Template {
            cargo_toml: include_str!("../../../plugin-template/Cargo.toml"),
            lib_rs: include_str!("../../../plugin-template/src/lib.rs"),
            crate_name: "optim_sgd",
            plugin_name: "sgd",
            check_section: Some("lr = 0.05"),
        },
        "data" => Template {
            cargo_toml: include_str!("../../../templates/data_ids/Cargo.toml"),
            lib_rs: include_str!("../../../templates/data_ids/src/lib.rs"),
            crate_name: "data_ids",
            plugin_name: "ids",
            check_section: None,
        },
        "drafter" => Template {
            cargo_toml: include_str!("../../../templates/drafter_tiny/Cargo.toml"),
            lib_rs: include_str!("../../../templates/drafter_tiny/src/lib.rs"),
            crate_name: "drafter_tiny",
            plugin_name: "tiny_drafter",
            check_section: None,
        },
        "target" => Template {
            cargo_toml: include_str!("../../../templates/target_tiny/Cargo.toml"),
            lib_rs: include_str!("../../../templates/target_tiny/src/lib.rs"),
            crate_name: "target_tiny",
            plugin_name: "tiny_lm",
            check_section: None,
        },
        k => bail!("--kind {k}: expected optimizer, data, drafter or target"),
    })
}

/// Rust's keywords (strict and reserved, all editions): none can name a crate.
const KEYWORDS: &[&str] = &[
    "abstract", "as", "async", "await", "become", "box", "break", "const", "continue", "crate", "do", "dyn", "else",
    "enum", "extern", "false", "final", "fn", "for", "gen", "if", "impl", "in", "let", "loop", "macro", "match", "mod",
    "move", "mut", "override", "priv", "pub", "ref", "return", "self", "static", "struct", "super", "trait", "true",
    "try", "type", "typeof", "unsafe", "unsized", "use", "virtual", "where", "while", "yield",
];

/// The crates of Rust's standard distribution, which a crate of the same name would shadow.
const STANDARD_CRATES: &[&str] = &["std", "core", "alloc", "proc_macro", "test"];

/// Why `name` cannot name the new crate and plugin, if it cannot: not a crate name, a keyword, a
/// standard crate, or a dependency of the template (`cargo_toml`'s), which it would shadow.
fn refuse_name(name: &str, cargo_toml: &str) -> Option<String> {
    if let Some(built) = lock_packages().find(|p| p.replace('-', "_") == name) {
        return Some(format!(
            "the name of `{built}`, a crate of the host's build, which the plugin's would shadow or whose \
             library it would replace in the shared target folder"
        ));
    }
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid {
        return Some("use lowercase letters, digits and `_`, starting with a letter".into());
    }
    if KEYWORDS.contains(&name) {
        return Some("a Rust keyword, which cannot name a crate".into());
    }
    if STANDARD_CRATES.contains(&name) {
        return Some(format!("the name of Rust's `{name}` crate, which the plugin's crate would shadow"));
    }
    let deps = cargo_toml.parse::<toml::Table>().ok()?;
    let deps = deps.get("dependencies")?.as_table()?;
    deps.keys()
        .find(|d| d.replace('-', "_") == name)
        .map(|d| format!("the name of `{d}`, a crate the plugin depends on, which its own crate would shadow"))
}

/// The host's own `Cargo.lock`: the scaffold builds with the versions the host was built with.
const CARGO_LOCK: &str = include_str!("../../../Cargo.lock");

/// The packages `Cargo.lock` names (the host's crates and their dependencies).
fn lock_packages() -> impl Iterator<Item = &'static str> {
    CARGO_LOCK.lines().filter_map(|l| l.strip_prefix("name = \"")?.strip_suffix('"'))
}

/// The libtorch this process runs on, as torch-sys's build should be told it: the `LIBTORCH`
/// the host was built with, written as it was (torch-sys builds again when the text differs),
/// where it is the library loaded; else the folder above the `lib/` that `libtorch_cpu.so` was
/// mapped from; else `$LIBTORCH`, else the set-up cache's.
fn libtorch_in_use() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mapped = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.ends_with("/libtorch_cpu.so"));
    let loaded = mapped.and_then(|p| Some(std::path::Path::new(p).parent()?.parent()?.to_path_buf()));
    let built = option_env!("DFLASH_BUILD_LIBTORCH")
        .map(PathBuf::from)
        .filter(|b| loaded.as_ref().is_none_or(|l| b.canonicalize().ok() == l.canonicalize().ok()));
    built
        .into_iter()
        .chain(loaded)
        .chain(std::env::var_os("LIBTORCH").map(PathBuf::from))
        .chain([crate::environment::cache_dir().join("libtorch")])
        .find(|p| p.join("lib").is_dir())
        .map(|p| std::path::absolute(&p).unwrap_or(p))
}

/// The cargo target folder this binary was built in (`<it>/release/dflash-host`), if it runs
/// from one.
fn host_target_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?.canonicalize().ok()?;
    let target = exe.parent()?.parent()?;
    (target.join("CACHEDIR.TAG").is_file() || target.join(".rustc_info.json").is_file()).then(|| target.to_path_buf())
}

/// `path` as a shell word: as is when it needs no quoting, else in single quotes.
fn shell_word(path: &std::path::Path) -> String {
    let s = path.display().to_string();
    if s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+,:=@".contains(c)) {
        s
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// `.cargo/config.toml` of the scaffold: the libtorch to build against and the target folder.
fn cargo_config(libtorch: Option<&std::path::Path>, target: Option<&std::path::Path>) -> String {
    let mut text = String::from(
        "# Written by `dflash-host plugins new`: build against the libtorch the host runs on, and into\n\
         # the host's target folder, where tch and torch-sys are compiled already (Cargo.lock pins the\n\
         # host's versions, Cargo.toml has its release profile), so a build compiles this crate only.\n",
    );
    if let Some(lt) = libtorch {
        text.push_str(&format!("[env]\nLIBTORCH = {:?}\n", lt.display().to_string()));
    }
    if let Some(t) = target {
        text.push_str(&format!("\n[build]\ntarget-dir = {:?}\n", t.display().to_string()));
    }
    text
}

/// The line of a template that names its plugin (`PluginInfo::new(PLUGIN_NAME, ..)` reads it).
fn plugin_name_line(name: &str) -> String {
    format!("const PLUGIN_NAME: &str = \"{name}\";")
}

/// "a" or "an" before `word`.
fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

pub fn run(args: NewArgs) -> Result<ExitCode> {
    let name = &args.name;
    let t = template(&args.kind)?;
    if let Some(why) = refuse_name(name, t.cargo_toml) {
        bail!("plugin name `{name}`: {why}; choose another");
    }
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(name));
    crate::experiment::guard::check_out_folder("--out", &out, &[])?;
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
    let folder = crate::outputs::OutDir::create("--out", &out, Vec::new())?;
    folder.write("Cargo.toml", cargo_toml.as_bytes())?;
    folder.subdir("src")?.write("lib.rs", rename(t.lib_rs).as_bytes())?;
    folder.write(".gitignore", b"target/\n")?;
    folder.write("Cargo.lock", CARGO_LOCK.as_bytes())?;
    let (libtorch, target) = (libtorch_in_use(), host_target_dir());
    folder.subdir(".cargo")?.write("config.toml", cargo_config(libtorch.as_deref(), target.as_deref()).as_bytes())?;
    crate::say!("wrote {} {} plugin `{name}` to {}", article(&args.kind), args.kind, out.display());
    if libtorch.is_none() {
        crate::say!(
            "warning: no libtorch found for the build: set LIBTORCH in {} (the folder holding lib/ and include/)",
            out.join(".cargo/config.toml").display()
        );
    }
    let dir = std::path::absolute(&out).unwrap_or(out.clone());
    let so = target.unwrap_or_else(|| dir.join("target")).join(format!("release/lib{name}.so"));
    let host = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("dflash-host"));
    let section = t.check_section.map_or(String::new(), |s| format!(" --section '{s}'"));
    crate::say!(
        "next: (cd {} && cargo build --release) && {} plugins check {}{section}",
        shell_word(&dir),
        shell_word(&host),
        shell_word(&so)
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_cannot_be_a_crate_or_would_shadow_one_are_refused_with_the_reason() {
        let toml = template("optimizer").unwrap().cargo_toml;
        assert_eq!(refuse_name("my_sgd", toml), None);
        assert!(refuse_name("Sgd", toml).unwrap().contains("lowercase"));
        assert!(refuse_name("self", toml).unwrap().contains("keyword"));
        assert!(refuse_name("std", toml).unwrap().contains("Rust's `std` crate"));
        assert!(refuse_name("plugin_api", toml).unwrap().contains("`plugin-api`, a crate of the host's build"));
        assert!(refuse_name("optim_adamw", toml).unwrap().contains("whose library it would replace"));
        assert!(refuse_name("serde", toml).is_some());
        assert_eq!((article("optimizer"), article("data"), article("target")), ("an", "a", "a"));
    }
}

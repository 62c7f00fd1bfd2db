//! The optimizer without the dylib: group routing, split parts, schedule scaling, state round
//! trip, init and state errors. Parity with torch is in tests/muon_parity.rs.

use super::*;
use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RResult, RVec},
    },
    author::Contained,
    tch::{self, Device},
    NamedTensor, Optimizer,
};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

fn cfg(text: &str) -> MuonConfig {
    MuonConfig::from_toml(text).unwrap()
}

/// Leaf parameters with random values, in order.
fn params(shapes: &[(&str, &[i64])], seed: i64) -> Vec<(String, Tensor)> {
    tch::manual_seed(seed);
    shapes.iter().map(|(n, s)| (n.to_string(), Tensor::randn(*s, F32).set_requires_grad(true))).collect()
}

fn named(ps: &[(String, Tensor)]) -> RVec<NamedTensor> {
    ps.iter().map(|(n, p)| NamedTensor::new(n.as_str(), p.shallow_clone())).collect()
}

fn deep_copy(ps: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    ps.iter().map(|(n, p)| (n.clone(), p.detach().copy().set_requires_grad(true))).collect()
}

/// Give every parameter the gradient `grads[i]` (d/dp sum(p * g) = g exactly).
fn set_grads(ps: &[(String, Tensor)], grads: &[Tensor]) {
    for ((_, p), g) in ps.iter().zip(grads) {
        let mut p = p.shallow_clone();
        p.zero_grad();
        (&p * g).sum(Kind::Float).backward();
    }
}

fn random_grads(ps: &[(String, Tensor)]) -> Vec<Tensor> {
    ps.iter().map(|(_, p)| Tensor::randn(p.size(), F32)).collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn new_opt(text: &str, ps: &[(String, Tensor)]) -> Contained<Muon> {
    let mut opt = Contained::new(Muon::new(cfg(text)));
    opt.init(named(ps)).unwrap();
    opt
}

const SHAPES: &[(&str, &[i64])] = &[
    ("model.embed_tokens.weight", &[11, 6]),
    ("layers.0.input_layernorm.weight", &[6]),
    ("layers.0.linear_attn.conv1d.weight", &[10, 1, 4]),
    ("layers.0.linear_attn.A_log", &[2]),
    ("layers.0.linear_attn.dt_bias", &[2]),
    ("layers.0.self_attn.q_proj.weight", &[8, 6]),
    ("layers.0.mlp.down_proj.weight", &[6, 9]),
    ("lm_head.weight", &[11, 6]),
];

#[test]
fn groups_by_name_and_shape() {
    let ps = params(SHAPES, 0);
    let opt = new_opt("", &ps);
    let groups: HashMap<String, Group> = opt.groups().into_iter().collect();
    let want = [
        ("model.embed_tokens.weight", Group::AdamW),
        ("layers.0.input_layernorm.weight", Group::AdamW),
        ("layers.0.linear_attn.conv1d.weight", Group::AdamW),
        ("layers.0.linear_attn.A_log", Group::AdamWNoDecay),
        ("layers.0.linear_attn.dt_bias", Group::AdamWNoDecay),
        ("layers.0.self_attn.q_proj.weight", Group::Muon),
        ("layers.0.mlp.down_proj.weight", Group::Muon),
        ("lm_head.weight", Group::AdamW),
    ];
    assert_eq!(groups.len(), want.len());
    for (n, g) in want {
        assert_eq!(groups[n], g, "{n}");
    }
    // Patterns are the config's: with none, only shape decides.
    let opt = new_opt("adamw_patterns = []\nno_decay_patterns = []", &ps);
    let groups: HashMap<String, Group> = opt.groups().into_iter().collect();
    assert_eq!(groups["model.embed_tokens.weight"], Group::Muon);
    assert_eq!(groups["layers.0.linear_attn.A_log"], Group::AdamW);
    assert_eq!(groups["layers.0.linear_attn.conv1d.weight"], Group::AdamW);
}

/// One step: AdamW-group parameters move exactly as `adamw_update` (A_log/dt_bias without decay),
/// Muon-group ones as wd then `adjusted_lr * NS(nesterov direction)`.
#[test]
fn each_group_gets_its_update() {
    let text = "lr = 0.02\nweight_decay = 0.1\nadjust_lr = \"original\"\nns_dtype = \"f32\"\nadamw = { lr = 3e-3, weight_decay = 0.05 }";
    let c = cfg(text);
    let ps = params(SHAPES, 1);
    let before = deep_copy(&ps);
    let mut opt = new_opt(text, &ps);
    let grads = random_grads(&ps);
    set_grads(&ps, &grads);
    opt.step(0.5).unwrap();
    let _guard = tch::no_grad_guard();
    for (((name, p), (_, p0)), g) in ps.iter().zip(&before).zip(&grads) {
        let mut want = p0.detach().copy();
        match c.route(name, &p.size()) {
            Group::Muon => {
                let lr = 0.02 * 0.5;
                let _ = want.g_mul_scalar_(1.0 - lr * 0.1);
                let mut buf = Tensor::zeros(p.size(), F32);
                let o = muon_update(g, &mut buf, 0.95, 5, true, 1e-7, Kind::Float);
                let (r, cols) = (p.size()[0], p.size()[1]);
                let _ = want.g_add_(&(o * -adjusted_lr(lr, AdjustLr::Original, r, cols)));
            }
            group => {
                let decay = if group == Group::AdamW { 0.05 } else { 0.0 };
                let h = ParamsAdamW { lr: 3e-3, weight_decay: decay, ..Default::default() };
                let (mut m, mut v) = (Tensor::zeros(p.size(), F32), Tensor::zeros(p.size(), F32));
                adamw_update(&mut want, g, &mut m, &mut v, 1, 3e-3 * 0.5, &h);
            }
        }
        assert!(p.allclose(&want, 1e-6, 1e-7, false), "{name}: max diff {:e}", max_diff(p, &want));
        assert!(max_diff(p, p0) > 1e-4, "{name} did not move");
    }
}

/// A fused matrix split [6, 3, 3] along dim 0: each part of the update is NS of that part alone
/// (scaled by that part's shape), not a slice of NS of the whole.
#[test]
fn split_parts_are_orthogonalised_separately() {
    let text = "lr = 0.1\nweight_decay = 0.0\nadjust_lr = \"original\"\nns_dtype = \"f32\"\nsplit = [{ pattern = \"*qkv_proj.weight\", parts = [6, 3, 3] }]";
    let ps = params(&[("layers.0.self_attn.qkv_proj.weight", &[12, 5])], 2);
    let p0 = ps[0].1.detach().copy();
    let mut opt = new_opt(text, &ps);
    let g = Tensor::randn([12, 5], F32);
    set_grads(&ps, std::slice::from_ref(&g));
    opt.step(1.0).unwrap();
    let delta = &ps[0].1.detach() - &p0;
    let whole = zeropower_via_newtonschulz5(&g, 5, 1e-7);
    let mut start = 0;
    for n in [6i64, 3, 3] {
        // With a zero buffer the Nesterov direction is (1 - mu^2) g; NS is scale-invariant.
        let part = zeropower_via_newtonschulz5(&g.narrow(0, start, n), 5, 1e-7);
        let got = delta.narrow(0, start, n) / -adjusted_lr(0.1, AdjustLr::Original, n, 5);
        assert!(got.allclose(&part, 1e-4, 1e-5, false), "part at row {start}: max diff {:e}", max_diff(&got, &part));
        assert!(max_diff(&got, &whole.narrow(0, start, n)) > 1e-2, "part at row {start} looks like NS of the whole");
        start += n;
    }
}

#[test]
fn split_errors_name_rule_and_parameter() {
    let ps = params(&[("a.qkv.weight", &[12, 5]), ("a.norm.weight", &[5])], 3);
    let err = |text: &str| {
        let mut opt = Contained::new(Muon::new(cfg(text)));
        opt.init(named(&ps)).into_result().unwrap_err().to_string()
    };
    let e = err("split = [{ pattern = \"*qkv.weight\", parts = [6, 3, 2] }]");
    assert!(e.contains("split[0].parts") && e.contains("a.qkv.weight") && e.contains("12 rows"), "{e}");
    let e = err("split = [{ pattern = \"*.weight\", parts = [6, 6] }]");
    assert!(e.contains("split[0].pattern") && e.contains("a.norm.weight") && e.contains("AdamW"), "{e}");
    let e = err("split = [{ pattern = \"*qkv_proj*\", parts = [6, 6] }]");
    assert!(e.contains("split[0].pattern") && e.contains("matches no parameter"), "{e}");
}

/// `step(s)` with lrs (a, b) equals `step(1)` with lrs (s a, s b): both groups follow the schedule.
#[test]
fn lr_scale_applies_to_both_groups() {
    let ps1 = params(SHAPES, 4);
    let ps2 = deep_copy(&ps1);
    let mut o1 = new_opt("lr = 0.02\nns_dtype = \"f32\"\nadamw = { lr = 4e-3 }", &ps1);
    let mut o2 = new_opt("lr = 0.005\nns_dtype = \"f32\"\nadamw = { lr = 1e-3 }", &ps2);
    assert_eq!(o1.base_lr().unwrap(), 0.02);
    for _ in 0..3 {
        let grads = random_grads(&ps1);
        set_grads(&ps1, &grads);
        set_grads(&ps2, &grads);
        o1.step(0.25).unwrap();
        o2.step(1.0).unwrap();
    }
    for ((n, a), (_, b)) in ps1.iter().zip(&ps2) {
        assert!(a.allclose(b, 1e-6, 1e-7, false), "{n}: max diff {:e}", max_diff(a, b));
    }
}

/// Save after 3 steps, load into a fresh optimizer over copies of the parameters, and both
/// continue identically for 3 more steps.
#[test]
fn state_round_trip_continues_identically() {
    let text = "lr = 0.02\nns_dtype = \"f32\"";
    let ps = params(SHAPES, 5);
    let mut a = new_opt(text, &ps);
    for _ in 0..3 {
        set_grads(&ps, &random_grads(&ps));
        a.step(1.0).unwrap();
    }
    let state = a.state().unwrap();
    let names: Vec<String> = state.iter().map(|nt| nt.name.to_string()).collect();
    assert!(names.contains(&"step".to_string()));
    assert!(names.contains(&"layers.0.self_attn.q_proj.weight.momentum_buffer".to_string()));
    assert!(names.contains(&"lm_head.weight.exp_avg".to_string()));
    assert!(names.contains(&"layers.0.linear_attn.A_log.exp_avg_sq".to_string()));
    assert_eq!(names.len(), 1 + 2 + 2 * 6, "{names:?}");

    let ps_b = deep_copy(&ps);
    let mut b = new_opt(text, &ps_b);
    b.load_state(state).unwrap();
    for _ in 0..3 {
        let grads = random_grads(&ps);
        set_grads(&ps, &grads);
        set_grads(&ps_b, &grads);
        a.step(0.7).unwrap();
        b.step(0.7).unwrap();
    }
    for ((n, x), (_, y)) in ps.iter().zip(&ps_b) {
        assert!(x.equal(y), "{n}: max diff {:e}", max_diff(x, y));
    }
    let sa: HashMap<String, Tensor> =
        a.state().unwrap().into_iter().map(|nt| (nt.name.to_string(), nt.tensor.into_tensor())).collect();
    for nt in b.state().unwrap() {
        assert!(nt.tensor.tensor().equal(&sa[nt.name.as_str()]), "state {}", nt.name);
    }
    assert_eq!(sa["step"].int64_value(&[]), 6);
}

#[test]
fn load_state_names_every_mismatch_and_changes_nothing() {
    let ps = params(SHAPES, 6);
    let mut opt = new_opt("", &ps);
    let good: Vec<NamedTensor> = opt.state().unwrap().into_iter().collect();
    let mut bad: Vec<NamedTensor> = good
        .iter()
        .filter(|nt| nt.name.as_str() != "layers.0.mlp.down_proj.weight.momentum_buffer")
        .map(|nt| {
            if nt.name.as_str() == "lm_head.weight.exp_avg" {
                NamedTensor::new("lm_head.weight.exp_avg", Tensor::zeros([3], F32))
            } else {
                nt.clone()
            }
        })
        .collect();
    bad.push(NamedTensor::new("stray.exp_avg", Tensor::zeros([1], F32)));
    let e = opt.load_state(bad.into()).into_result().unwrap_err().to_string();
    assert!(e.contains("missing `layers.0.mlp.down_proj.weight.momentum_buffer`"), "{e}");
    assert!(e.contains("`lm_head.weight.exp_avg`: shape [3], expected [11, 6]"), "{e}");
    assert!(e.contains("unexpected `stray.exp_avg`"), "{e}");
    // Nothing was committed: the good state still loads, and the buffers are still the zeros.
    let e =
        opt.load_state(good.into_iter().filter(|nt| nt.name.as_str() != "step").collect()).into_result().unwrap_err();
    assert!(e.to_string().contains("missing `step`"), "{e}");
    for nt in opt.state().unwrap() {
        assert_eq!(nt.tensor.tensor().abs().sum(Kind::Double).double_value(&[]), 0.0, "{}", nt.name);
    }
}

/// bf16 parameters train through fp32 master copies that are checkpointed; the parameter is the
/// rounded master.
#[test]
fn bf16_parameters_keep_fp32_masters() {
    tch::manual_seed(7);
    let p = Tensor::randn([8, 6], F32).to_kind(Kind::BFloat16).set_requires_grad(true);
    let n = Tensor::randn([6], F32).to_kind(Kind::BFloat16).set_requires_grad(true);
    let ps = vec![("w".to_string(), p), ("n".to_string(), n)];
    let mut opt = new_opt("lr = 0.02\nns_dtype = \"bf16\"", &ps);
    set_grads(
        &ps,
        &[Tensor::randn([8, 6], F32).to_kind(Kind::BFloat16), Tensor::randn([6], F32).to_kind(Kind::BFloat16)],
    );
    opt.step(1.0).unwrap();
    let state: HashMap<String, Tensor> =
        opt.state().unwrap().into_iter().map(|nt| (nt.name.to_string(), nt.tensor.into_tensor())).collect();
    for (name, p) in &ps {
        let master = &state[&format!("{name}.master")];
        assert_eq!(master.kind(), Kind::Float);
        assert_eq!(p.kind(), Kind::BFloat16);
        assert!(p.equal(&master.to_kind(Kind::BFloat16)), "{name}");
    }
    assert_eq!(state["w.momentum_buffer"].kind(), Kind::Float);
}

/// Parameters without a gradient are left alone (and their state too), like torch.
#[test]
fn parameters_without_grad_are_skipped() {
    let ps = params(&[("w", &[4, 5]), ("b", &[5])], 8);
    let before = deep_copy(&ps);
    let mut opt = new_opt("", &ps);
    opt.step(1.0).unwrap();
    for ((n, a), (_, b)) in ps.iter().zip(&before) {
        assert!(a.equal(b), "{n}");
    }
}

#[test]
fn plugin_info_and_create() {
    assert_eq!(info().name.as_str(), "muon");
    assert_eq!(info().kind, PluginKind::Optimizer);
    let ctx = HostContext::cpu();
    let Ok(PluginInstance::Optimizer(opt)) = create("lr = 0.05", &ctx) else { panic!("not an optimizer") };
    assert_eq!(opt.base_lr().unwrap(), 0.05);
    let Err(e) = create("momentum = 2.0", &ctx) else { panic!("bad config accepted") };
    assert!(e.to_string().contains("field `momentum`"), "{e}");
}

/// A >2-D matrix without size-1 dims is orthogonalised as [shape[0], rest]; one that can't be
/// viewed that way is refused at init, not half way through a step.
#[test]
fn higher_rank_matrices_are_flattened() {
    let ps = params(&[("w", &[4, 3, 5])], 9);
    let p0 = ps[0].1.detach().copy();
    let mut opt = new_opt("lr = 0.1\nweight_decay = 0.0\nadjust_lr = \"original\"\nns_dtype = \"f32\"", &ps);
    assert_eq!(opt.groups(), vec![("w".to_string(), Group::Muon)]);
    let g = Tensor::randn([4, 3, 5], F32);
    set_grads(&ps, std::slice::from_ref(&g));
    opt.step(1.0).unwrap();
    let got = (&ps[0].1.detach() - &p0).reshape([4, 15]) / -adjusted_lr(0.1, AdjustLr::Original, 4, 15);
    let want = zeropower_via_newtonschulz5(&g.reshape([4, 15]), 5, 1e-7);
    assert!(got.allclose(&want, 1e-4, 1e-5, false), "max diff {:e}", max_diff(&got, &want));

    let permuted = Tensor::randn([5, 3, 4], F32).permute([2, 1, 0]).set_requires_grad(true);
    let mut opt = Contained::new(Muon::new(cfg("")));
    let e = opt.init(vec![NamedTensor::new("v", permuted)].into()).into_result().unwrap_err().to_string();
    assert!(e.contains("parameter `v`") && e.contains("[4, 15]"), "{e}");
}

/// Collectives between threads of one process, for distributed Muon without c10d: each rank
/// posts its input, waits for all, reads everyone's.
struct ThreadCollectives {
    rank: u32,
    world: u32,
    slots: std::sync::Arc<(std::sync::Mutex<Vec<Option<Tensor>>>, std::sync::Barrier)>,
    /// Newton-Schulz parts this rank orthogonalised (counted through all-gather input sizes).
    sent: std::sync::Arc<std::sync::Mutex<Vec<i64>>>,
}

impl plugin_api::Collectives for ThreadCollectives {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn all_gather(
        &mut self,
        outputs: plugin_api::abi_stable::std_types::RSlice<'_, TensorHandle>,
        input: &TensorHandle,
    ) -> RResult<(), PluginError> {
        let (slots, barrier) = &*self.slots;
        slots.lock().unwrap()[self.rank as usize] = Some(input.tensor().copy());
        self.sent.lock().unwrap().push(input.tensor().numel() as i64);
        barrier.wait();
        for (r, out) in outputs.iter().enumerate() {
            out.tensor().copy_(slots.lock().unwrap()[r].as_ref().unwrap());
        }
        barrier.wait();
        RResult::ROk(())
    }
}

/// 2 and 3 ranks (threads, each its own copy of the parameters and state, the same gradients):
/// every rank's parameters and momentum equal one process's Muon after 3 steps, split parts and
/// the AdamW group included, and the Newton-Schulz work is split: no rank computes every part.
#[test]
fn distributed_muon_equals_one_process() {
    let text = "lr = 0.02\nweight_decay = 0.1\nns_dtype = \"f32\"\nsplit = [{ pattern = \"*qkv_proj.weight\", parts = [6, 3, 3] }]";
    let mut shapes = SHAPES.to_vec();
    shapes.push(("layers.0.self_attn.qkv_proj.weight", &[12, 6]));
    shapes.push(("layers.0.mlp.up_proj.weight", &[16, 6]));
    let ps = params(&shapes, 4);
    let grads: Vec<Vec<Tensor>> = (0..3).map(|_| random_grads(&ps)).collect();
    fn run(ps: &[(String, Tensor)], opt: &mut Contained<Muon>, grads: &[Vec<Tensor>]) {
        for g in grads {
            set_grads(ps, g);
            opt.step(1.0).unwrap();
        }
    }
    let copy_grads = || -> Vec<Vec<Tensor>> { grads.iter().map(|gs| gs.iter().map(|g| g.copy()).collect()).collect() };
    let one = deep_copy(&ps);
    let mut single = new_opt(text, &one);
    run(&one, &mut single, &grads);
    let want: HashMap<String, Tensor> = single.state_impl().into_iter().collect();

    // Each rank's parameters and optimizer state after the steps, and the first size it sent.
    type RankResult = (Vec<(String, Tensor)>, Vec<(String, Tensor)>, i64);
    for world in [2u32, 3] {
        let slots = std::sync::Arc::new((
            std::sync::Mutex::new((0..world).map(|_| None).collect()),
            std::sync::Barrier::new(world as usize),
        ));
        let results: Vec<RankResult> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (slots, mine, grads) = (slots.clone(), deep_copy(&ps), copy_grads());
                    s.spawn(move || {
                        let sent = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
                        let k = ThreadCollectives { rank, world, slots, sent: sent.clone() };
                        let mut opt = Contained::new(
                            Muon::new(cfg(text)).with_collectives(plugin_api::Collectives_TO::from_value(k, TD_Opaque)),
                        );
                        opt.init(named(&mine)).unwrap();
                        run(&mine, &mut opt, &grads);
                        let first = sent.lock().unwrap()[0];
                        (mine, opt.state_impl(), first)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let all_parts: i64 = one
            .iter()
            .filter(|(n, p)| cfg(text).route(n, &p.size()) == Group::Muon)
            .map(|(_, p)| p.numel() as i64)
            .sum();
        for (rank, (mine, state, sent)) in results.iter().enumerate() {
            for ((name, p), (_, p1)) in mine.iter().zip(&one) {
                let d = max_diff(p, p1);
                assert!(d <= 1e-6, "world {world}, rank {rank}: {name} differs from one process by {d:e}");
            }
            for (name, t) in state {
                let d = max_diff(t, &want[name.as_str()]);
                assert!(d <= 1e-6, "world {world}, rank {rank}: state {name} differs by {d:e}");
            }
            // Each rank's buffer is padded to the longest: all ranks send the same length, less
            // than every part together.
            assert!(*sent < all_parts, "world {world}, rank {rank}: sent {sent} of {all_parts} values: no split");
        }
    }
}

/// State by role in: a matrix takes the first moment as its momentum and leaves the second; the
/// AdamW group takes both; a first moment alone seeds the AdamW group's second. A misshapen role
/// or an unknown parameter is an error that changes nothing.
#[test]
fn import_maps_roles_onto_the_groups_and_changes_nothing_on_an_error() {
    use plugin_api::{roles, OptimizerPlugin as _};
    let ps = params(&[("w.weight", &[4, 3]), ("norm.weight", &[3]), ("up.weight", &[2, 3])], 0);
    let mut opt = Muon::new(cfg(""));
    opt.init_impl(deep_copy(&ps)).unwrap();
    let role = |r: &str, shape: &[i64]| (r.to_string(), Tensor::randn(shape, F32));
    let given = vec![
        (
            "w.weight".to_string(),
            Roles::from([role(roles::FIRST_MOMENT, &[4, 3]), role(roles::SECOND_MOMENT, &[4, 3])]),
        ),
        ("norm.weight".to_string(), Roles::from([role(roles::FIRST_MOMENT, &[3]), role(roles::SECOND_MOMENT, &[3])])),
    ];
    let copy = |g: &[(String, Roles)]| -> Vec<(String, Roles)> {
        g.iter().map(|(n, r)| (n.clone(), r.iter().map(|(k, t)| (k.clone(), t.copy())).collect())).collect()
    };
    // Errors first: nothing changes.
    let mut bad = copy(&given);
    bad[1].1.insert(roles::SECOND_MOMENT.into(), Tensor::zeros([4], F32));
    let e = opt.import_state(StateByRole { step: Some(9), params: bad }).unwrap_err();
    assert_eq!(e.to_string(), "carried state of `norm.weight`: `second_moment` has shape [4], the parameter [3]");
    let mut unknown = copy(&given);
    unknown.push(("nothing.weight".into(), Roles::new()));
    let e = opt.import_state(StateByRole { step: Some(9), params: unknown }).unwrap_err();
    assert!(e.to_string().contains("`nothing.weight`, which is not a parameter"), "{e}");
    assert_eq!(opt.step, 0);
    assert_eq!(opt.muon[0].momentum_buffer.abs().sum(Kind::Float).double_value(&[]), 0.0);

    let report = opt.import_state(StateByRole { step: Some(9), params: copy(&given) }).unwrap().unwrap();
    assert_eq!(opt.step, 9);
    assert!(opt.muon[0].momentum_buffer.equal(&given[0].1[roles::FIRST_MOMENT]));
    assert!(opt.adamw[0].exp_avg.equal(&given[1].1[roles::FIRST_MOMENT]));
    assert!(opt.adamw[0].exp_avg_sq.equal(&given[1].1[roles::SECOND_MOMENT]));
    // `up.weight` was not given: still fresh.
    assert_eq!(opt.muon[1].momentum_buffer.abs().sum(Kind::Float).double_value(&[]), 0.0);
    let count = |m: &[(&str, u64)]| m.iter().map(|(r, n)| (r.to_string(), *n)).collect();
    assert_eq!(report.used, count(&[(roles::FIRST_MOMENT, 2), (roles::SECOND_MOMENT, 1)]));
    assert_eq!(report.ignored, count(&[(roles::SECOND_MOMENT, 1)]));
    assert!(report.step && report.notes.is_empty());

    // The AdamW group given a first moment alone seeds the second, and says so.
    let alone = vec![("norm.weight".to_string(), Roles::from([role(roles::FIRST_MOMENT, &[3])]))];
    let report = opt.import_state(StateByRole { step: None, params: alone }).unwrap().unwrap();
    assert!(opt.adamw[0].exp_avg_sq.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    assert_eq!(report.notes, vec!["second_moment seeded from first_moment for 1 parameters".to_string()]);
    assert!(!report.step && opt.step == 9);
}

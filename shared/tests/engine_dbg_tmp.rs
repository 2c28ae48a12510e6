use sequoia_shared::engine::{LoadOptions, Model};
use sequoia_shared::models;
#[test]
#[ignore]
fn dbg() {
    let path = models::ensure_model(models::QWEN_CODER_0_5B).unwrap();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let prefix: Vec<u32> = vec![
        750, 75698, 1445, 982, 262, 4210, 5598, 279, 308, 7563, 79683, 1372, 13,
    ];
    let seq: Vec<u32> = vec![220, 262, 421, 308];
    let mut c = model.new_cache();
    model.forward_chain_last(&mut c, &prefix).unwrap();
    let mut a = vec![];
    for &t in &seq {
        a = model.forward_chain_last(&mut c, &[t]).unwrap();
    }
    let mut c2 = model.new_cache();
    model.forward_chain_last(&mut c2, &prefix).unwrap();
    let b = model.forward_chain_last(&mut c2, &seq).unwrap();
    let mut c3 = model.new_cache();
    let mut all = prefix.clone();
    all.extend(&seq);
    let c3l = model.forward_chain_last(&mut c3, &all).unwrap();
    let d = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max)
    };
    println!(
        "decode vs chain(seq): {}  decode vs prefill(all): {}  chain vs prefill {}",
        d(&a, &b),
        d(&a, &c3l),
        d(&b, &c3l)
    );
    println!("max |logit| {}", a.iter().fold(0f32, |m, v| m.max(v.abs())));
}

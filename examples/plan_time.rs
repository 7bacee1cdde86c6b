use kvcsum::*;
use std::time::Instant;
fn main() {
    let buf = vec![0u64; 1 << 20];
    let mut w = Worker::new(WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: None,
        num_threads: 1,
    })
    .unwrap();
    w.add_region(Region {
        address: buf.as_ptr() as u64,
        length: 8 << 20,
    })
    .unwrap();
    w.add_group(0, 16).unwrap();
    for l in 0..32 {
        w.add_layer(LayerSpec {
            group_id: 0,
            layer_number: l,
            first_head: 0,
            num_heads: 8,
            replica: ReplicaKey {
                replicas: 1,
                replica_index: 0,
            },
            num_blocks: 4096,
            kernel_blocks: 1,
            tokens_per_kernel_block: 16,
            segments: vec![Segment {
                address: buf.as_ptr() as u64,
                block_stride: 0,
                kernel_block_stride: 0,
                head_stride: 0,
                token_stride: 0,
                bytes_per_token: 512,
            }],
            identity: vec![],
        })
        .unwrap();
    }
    let mut b = BlockSet::new();
    for r in 0..128 {
        let id = format!("req-{r}");
        b.add_request(&id, 256).unwrap();
        let ids: Vec<u32> = (0..16).map(|i| (r * 16 + i) as u32).collect();
        b.add_group(&id, 0, 0, &ids).unwrap();
    }
    let mut t = Vec::new();
    for _ in 0..50 {
        let s = Instant::now();
        let p = kvcsum::plan::Plan::new(w.layout(), &b, Role::Consumer).unwrap();
        t.push(s.elapsed().as_secs_f64() * 1e6);
        drop(p);
    }
    t.sort_by(f64::total_cmp);
    println!("Plan::new median {:.2} us", t[t.len() / 2]);
}

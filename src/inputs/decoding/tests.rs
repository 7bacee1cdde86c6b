use super::*;

#[test]
fn undeclared_facts_are_not_compared_and_declared_ones_are() {
    let a = LayerDecoding::from_parts("fp8_e4m3", 0, 0.5f64.to_bits(), 0).unwrap();
    let b = LayerDecoding::from_parts("", 128, 0.5f64.to_bits(), 0.25f64.to_bits()).unwrap();
    assert_eq!(a.first_difference(&b), None);
    let merged = a.merge(&b).unwrap();
    assert_eq!(merged.parts(), ("fp8_e4m3", 128, 0.5f64.to_bits(), 0.25f64.to_bits()));
    let c = LayerDecoding::from_parts("fp8_e4m3", 0, 0.25f64.to_bits(), 0).unwrap();
    let difference = a.first_difference(&c).unwrap();
    assert_eq!(difference.field, "k_scale");
    assert!(difference.first.starts_with("0.5 "), "{difference:?}");
    assert!(difference.second.starts_with("0.25 "), "{difference:?}");
    let d = LayerDecoding::from_parts("bfloat16", 0, 0, 0).unwrap();
    assert_eq!(a.first_difference(&d).unwrap().field, "dtype");
}

fn run(layer_number: u32, first_head: u32, num_heads: u32, cell_bytes: u32, k_bytes: u32) -> LayerGeometry {
    LayerGeometry {
        layer_number,
        first_head,
        num_heads,
        cell_bytes,
        k_bytes,
    }
}

#[test]
fn geometry_of_several_workers_joins_and_other_cells_differ() {
    // TP 2 halves and a replica of the first half join into one run;
    // an indexer's heads after them stay a run of their own.
    let merged = merge_geometry([
        run(3, 4, 4, 256, 128),
        run(3, 0, 4, 256, 0),
        run(3, 0, 4, 256, 128),
        run(3, 8, 1, 136, 0),
    ])
    .unwrap();
    assert_eq!(merged, vec![run(3, 0, 8, 256, 128), run(3, 8, 1, 136, 0)]);
    let conflict = merge_geometry([run(3, 0, 4, 256, 0), run(3, 2, 4, 128, 0)]).unwrap_err();
    assert_eq!(
        (conflict.field, conflict.heads, conflict.first, conflict.second),
        ("cell_bytes", (2, 4), 256, 128)
    );
    // Sides: heads, then cell bytes, then K bytes where both know them.
    let ours = [run(1, 0, 8, 256, 0), run(2, 0, 8, 256, 128)];
    assert_eq!(first_geometry_difference(&ours, &ours), None);
    let d = first_geometry_difference(&ours, &[run(1, 0, 4, 256, 0)]).unwrap();
    assert_eq!((d.layer_number, d.field, d.first, d.second), (1, "heads", 8, 4));
    let d = first_geometry_difference(&ours, &[run(2, 0, 4, 256, 128), run(2, 4, 4, 512, 256)]).unwrap();
    assert_eq!(
        (d.layer_number, d.field, d.heads, d.first, d.second),
        (2, "cell_bytes", (4, 8), 256, 512)
    );
    let d = first_geometry_difference(&ours, &[run(2, 0, 8, 256, 64)]).unwrap();
    assert_eq!((d.field, d.first, d.second), ("k_bytes", 128, 64));
    assert_eq!(
        first_geometry_difference(&ours, &[run(2, 0, 8, 256, 0), run(9, 0, 1, 8, 0)]),
        None
    );
}

#[test]
fn bad_declarations_name_the_field_and_value() {
    let nan = LayerDecoding::from_parts("fp8_e4m3", 0, f64::NAN.to_bits(), 0).unwrap_err();
    assert!(nan.to_string().contains("k_scale NaN"), "{nan}");
    let negative = LayerDecoding::from_parts("", 0, 0, (-1.0f64).to_bits()).unwrap_err();
    assert!(negative.to_string().contains("v_scale -1.0"), "{negative}");
    for name in [
        "FP8",
        "8bit",
        "fp8-e4m3",
        "torch.float8",
        &"a".repeat(MAX_DTYPE_LEN + 1),
    ] {
        let error = LayerDecoding::from_parts(name, 0, 0, 0).unwrap_err();
        assert!(
            error.to_string().contains("is not an element type name"),
            "{name}: {error}"
        );
    }
    assert!(LayerDecoding::from_parts(&"a".repeat(MAX_DTYPE_LEN), 0, 0, 0).is_ok());
    let nothing = LayerDecoding::from_parts("", 0, 0, 0).unwrap_err();
    assert!(nothing.to_string().contains("declares nothing"), "{nothing}");
}

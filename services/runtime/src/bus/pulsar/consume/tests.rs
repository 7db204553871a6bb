use super::*;

#[test]
fn a_negative_permit_count_from_the_broker_reads_as_negative() {
    assert_eq!(signed_permits(1_000), 1_000);
    assert_eq!(signed_permits(0), 0);
    // Java's `int` -3, sign-extended into the protocol's uint64.
    assert_eq!(signed_permits(u64::MAX - 2), -3);
}

#[test]
fn non_persistent_consumers_keep_permits_for_a_burst_of_their_concurrency() {
    assert_eq!(flow_permits("persistent://t/n/x", 64), 64);
    assert_eq!(flow_permits("persistent://t/n/x", 0), 1);
    assert_eq!(flow_permits("non-persistent://t/n/x", 64), 1000);
    assert_eq!(flow_permits("non-persistent://t/n/x", 512), 1025);
    // pulsar-rs re-flows only below half its batch: what is left must cover a burst.
    for prefetch in [1, 64, 256, 512, 4096] {
        let permits = flow_permits("non-persistent://t/n/x", prefetch);
        assert!(permits.div_ceil(2) > prefetch, "{prefetch}: {permits}");
    }
}

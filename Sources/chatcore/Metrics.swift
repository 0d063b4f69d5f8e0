import ChatMetrics
import CoreMetrics
import Foundation
import Prometheus
import Synchronization

/// swift-metrics' metrics as Prometheus families in `registry`, each with its `# HELP`
/// (`ServiceMetrics.help`): swift-prometheus' own factory gives none.
struct DescribedMetricsFactory: MetricsFactory {
    let registry: PrometheusCollectorRegistry

    private func descriptor(_ label: String) -> MetricNameDescriptor {
        MetricNameDescriptor(metricName: label, unitName: "", helpText: ServiceMetrics.help(of: label))
    }

    func makeCounter(label: String, dimensions: [(String, String)]) -> any CounterHandler {
        registry.makeCounter(descriptor: descriptor(label), labels: dimensions)
    }

    func makeFloatingPointCounter(label: String, dimensions: [(String, String)]) -> any FloatingPointCounterHandler {
        registry.makeCounter(descriptor: descriptor(label), labels: dimensions)
    }

    func makeRecorder(label: String, dimensions: [(String, String)], aggregate: Bool) -> any RecorderHandler {
        guard aggregate else { return registry.makeGauge(descriptor: descriptor(label), labels: dimensions) }
        let buckets = ServiceMetrics.valueBuckets[label] ?? [1, 10, 100, 1000, 10000]
        return registry.makeValueHistogram(descriptor: descriptor(label), labels: dimensions, buckets: buckets)
    }

    func makeMeter(label: String, dimensions: [(String, String)]) -> any MeterHandler {
        registry.makeGauge(descriptor: descriptor(label), labels: dimensions)
    }

    func makeTimer(label: String, dimensions: [(String, String)]) -> any TimerHandler {
        let buckets = ServiceMetrics.durationBuckets[label] ?? [.milliseconds(1), .milliseconds(10), .milliseconds(100), .seconds(1)]
        return registry.makeDurationHistogram(descriptor: descriptor(label), labels: dimensions, buckets: buckets)
    }

    func destroyCounter(_ handler: any CounterHandler) {
        if let counter = handler as? Prometheus.Counter { registry.unregisterCounter(counter) }
    }

    func destroyFloatingPointCounter(_ handler: any FloatingPointCounterHandler) {
        if let counter = handler as? Prometheus.Counter { registry.unregisterCounter(counter) }
    }

    func destroyRecorder(_ handler: any RecorderHandler) {
        if let gauge = handler as? Prometheus.Gauge { registry.unregisterGauge(gauge) }
        if let histogram = handler as? ValueHistogram { registry.unregisterValueHistogram(histogram) }
    }

    func destroyMeter(_ handler: any MeterHandler) {
        if let gauge = handler as? Prometheus.Gauge { registry.unregisterGauge(gauge) }
    }

    func destroyTimer(_ handler: any TimerHandler) {
        if let histogram = handler as? DurationHistogram { registry.unregisterDurationHistogram(histogram) }
    }
}

/// The process as Prometheus' client libraries describe one (`process_*`), read from
/// `/proc` at each scrape, and the build (`chatcore_build_info`).
final class ProcessMetrics: Sendable {
    private let residentBytes: Prometheus.Gauge
    private let virtualBytes: Prometheus.Gauge
    private let cpuSeconds: Prometheus.Counter
    private let openDescriptors: Prometheus.Gauge
    private let maxDescriptors: Prometheus.Gauge
    /// CPU seconds counted so far (the counter only moves on).
    private let counted = Mutex<Double>(0)

    init(registry: PrometheusCollectorRegistry, version: String) {
        func named(_ name: String, _ help: String) -> MetricNameDescriptor {
            MetricNameDescriptor(metricName: name, unitName: "", helpText: help)
        }
        residentBytes = registry.makeGauge(descriptor: named("process_resident_memory_bytes", "Resident memory size in bytes."))
        virtualBytes = registry.makeGauge(descriptor: named("process_virtual_memory_bytes", "Virtual memory size in bytes."))
        cpuSeconds = registry.makeCounter(descriptor: named("process_cpu_seconds_total", "Total user and system CPU time spent in seconds."))
        openDescriptors = registry.makeGauge(descriptor: named("process_open_fds", "Number of open file descriptors."))
        maxDescriptors = registry.makeGauge(descriptor: named("process_max_fds", "Maximum number of open file descriptors."))
        let start = registry.makeGauge(descriptor: named("process_start_time_seconds", "Start time of the process since the Unix epoch in seconds."))
        start.set(ProcessMetrics.startTime() ?? Date().timeIntervalSince1970)
        let build = registry.makeGauge(
            descriptor: named("chatcore_build_info", "The chatcore build serving: its version, as chatcore --version prints it."),
            labels: [("version", version)])
        build.set(1.0)
    }

    /// Reads the process's figures now.
    func update() {
        let pageSize = Double(sysconf(Int32(_SC_PAGESIZE)))
        if let statm = try? String(contentsOfFile: "/proc/self/statm", encoding: .utf8) {
            let fields = statm.split(separator: " ").compactMap { Double($0) }
            if fields.count >= 2 {
                virtualBytes.set(fields[0] * pageSize)
                residentBytes.set(fields[1] * pageSize)
            }
        }
        var usage = rusage()
        if getrusage(RUSAGE_SELF.rawValue, &usage) == 0 {
            let seconds =
                Double(usage.ru_utime.tv_sec) + Double(usage.ru_utime.tv_usec) / 1e6 + Double(usage.ru_stime.tv_sec)
                + Double(usage.ru_stime.tv_usec) / 1e6
            let delta = counted.withLock { counted -> Double in
                let delta = max(0, seconds - counted)
                counted += delta
                return delta
            }
            if delta > 0 { cpuSeconds.increment(by: delta) }
        }
        if let open = try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd") {
            openDescriptors.set(Double(open.count))
        }
        var limit = rlimit()
        if getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0 { maxDescriptors.set(Double(limit.rlim_cur)) }
    }

    /// When the process started, from its start in clock ticks after boot (`/proc/self/stat`)
    /// and the boot time (`/proc/stat`).
    private static func startTime() -> Double? {
        guard let stat = try? String(contentsOfFile: "/proc/self/stat", encoding: .utf8),
            let afterName = stat.range(of: ")", options: .backwards)
        else { return nil }
        // Fields after the name start at the third (state); the start time is the 22nd.
        let fields = stat[afterName.upperBound...].split(separator: " ")
        guard fields.count > 19, let ticks = Double(fields[19]),
            let system = try? String(contentsOfFile: "/proc/stat", encoding: .utf8),
            let bootLine = system.split(separator: "\n").first(where: { $0.hasPrefix("btime ") }),
            let boot = Double(bootLine.dropFirst("btime ".count))
        else { return nil }
        return boot + ticks / Double(sysconf(Int32(_SC_CLK_TCK)))
    }
}

//! Storage health: which storage components (the log, a store) cannot read or write right
//! now, since when and why. Components report each failed operation and their recovery; the
//! gRPC service turns the state into `grpc.health.v1` statuses, and every failure counts in
//! `taskstream_storage_errors_total{component}`. Nothing here retries: healing is the
//! component's own business (the log reopens its file after an I/O error).

use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::watch;

/// The kind of a failing component, the `component` label of the error counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StorageComponent {
    /// The embedded log (`log.redb`).
    Log,
    /// A task's persistent store.
    Store,
}

impl StorageComponent {
    pub fn as_str(self) -> &'static str {
        match self {
            StorageComponent::Log => "log",
            StorageComponent::Store => "store",
        }
    }
}

/// A component that is failing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageFault {
    pub component: StorageComponent,
    /// Which one: the log's file, or a store's task id.
    pub name: String,
    /// The first failure since the component last worked.
    pub since: SystemTime,
    /// The latest error.
    pub error: String,
    /// Failed operations since `since`.
    pub errors: u64,
}

/// Shared by the components that report and the service that watches. A std mutex: it is held
/// for a map update, never across an await or I/O.
pub struct StorageHealth {
    faults: Mutex<BTreeMap<(StorageComponent, String), StorageFault>>,
    /// Bumped on every change of the set of failing components.
    changes: watch::Sender<u64>,
}

impl StorageHealth {
    pub fn new() -> Arc<StorageHealth> {
        Arc::new(StorageHealth {
            faults: Mutex::new(BTreeMap::new()),
            changes: watch::Sender::new(0),
        })
    }

    /// Records a failed operation of `component` `name`: counted, and the component is failing
    /// until `recovered`.
    pub fn failed(&self, component: StorageComponent, name: &str, error: &dyn Display) {
        metrics::counter!(crate::metrics::STORAGE_ERRORS, "component" => component.as_str()).increment(1);
        let error = error.to_string();
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        match faults.get_mut(&(component, name.to_string())) {
            Some(fault) => {
                fault.errors += 1;
                fault.error = error;
            }
            None => {
                tracing::error!(component = component.as_str(), name, %error, "storage failing");
                faults.insert(
                    (component, name.to_string()),
                    StorageFault {
                        component,
                        name: name.to_string(),
                        since: SystemTime::now(),
                        error,
                        errors: 1,
                    },
                );
                drop(faults);
                self.changes.send_modify(|version| *version += 1);
            }
        }
    }

    /// `component` `name` works again.
    pub fn recovered(&self, component: StorageComponent, name: &str) {
        let removed = self
            .faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(component, name.to_string()));
        if let Some(fault) = removed {
            let failing_for = fault.since.elapsed().unwrap_or(Duration::ZERO);
            tracing::info!(
                component = component.as_str(),
                name,
                ?failing_for,
                errors = fault.errors,
                "storage recovered"
            );
            self.changes.send_modify(|version| *version += 1);
        }
    }

    /// What is failing now, in (component, name) order.
    pub fn faults(&self) -> Vec<StorageFault> {
        self.faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Whether nothing is failing.
    pub fn is_healthy(&self) -> bool {
        self.faults.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    pub fn is_failing(&self, component: StorageComponent) -> bool {
        self.faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .any(|(c, _)| *c == component)
    }

    /// Changes whenever a component starts failing or recovers.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_lasts_from_its_first_failure_until_recovery_and_each_change_is_announced() {
        let health = StorageHealth::new();
        let mut changes = health.subscribe();
        assert!(health.faults().is_empty());
        health.failed(StorageComponent::Log, "log.redb", &"No space left on device");
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        let since = health.faults()[0].since;
        health.failed(StorageComponent::Log, "log.redb", &"still full");
        assert!(
            !changes.has_changed().unwrap(),
            "a further failure changes nothing"
        );
        let faults = health.faults();
        assert_eq!(faults.len(), 1);
        assert_eq!((faults[0].errors, faults[0].since), (2, since));
        assert_eq!(faults[0].error, "still full");
        assert!(health.is_failing(StorageComponent::Log));
        assert!(!health.is_failing(StorageComponent::Store));
        assert!(!health.is_healthy());
        health.recovered(StorageComponent::Store, "counts_0");
        assert!(
            !changes.has_changed().unwrap(),
            "recovering what never failed changes nothing"
        );
        health.recovered(StorageComponent::Log, "log.redb");
        assert!(changes.has_changed().unwrap());
        assert!(health.faults().is_empty());
        assert!(health.is_healthy());
    }
}

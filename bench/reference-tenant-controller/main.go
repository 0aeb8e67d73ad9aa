// Command reference-tenant-controller is the controller-runtime reference that `cargo xtask
// bench` measures Steward's tenant-operator against. It is deliberately minimal and written the
// way a kubebuilder user would write it, but it reconciles the same Tenant (unstructured,
// tenancy.steward.dev/v1alpha1) into the same objects with the same writes:
//
//   - a finalizer `tenancy.steward.dev/namespaces` on the Tenant;
//   - per namespace in spec.namespaces, by server-side apply: the Namespace (tenant labels,
//     Pod Security level, propagated metadata), RoleBindings `tenant-owner-<role>` and
//     `tenant-<role>`, ResourceQuota `tenant-quota`, LimitRange `tenant-limits`, NetworkPolicy
//     `tenant-isolation`;
//   - per tenant: ClusterRole and ClusterRoleBinding `tenancy.steward.dev:owner:<tenant>`;
//   - status (observedGeneration, phase, namespaces, Ready condition) by server-side apply,
//     skipped when unchanged.
//
// Children are watched through caches scoped by the tenant label. Flags mirror Steward's
// common flags (leader election, metrics and probe addresses, concurrency) plus the client's
// rate limits (--kube-api-qps/--kube-api-burst; -1 = no client-side limit, controller-runtime's
// default since v0.19; client-go's own default is 5/10).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
)

const (
	group         = "tenancy.steward.dev"
	tenantLabel   = "tenancy.steward.dev/tenant"
	declaredLabel = "tenancy.steward.dev/declared"
	cordonedLabel = "tenancy.steward.dev/cordoned"
	podSecurity   = "pod-security.kubernetes.io/enforce"
	ownerLabel    = "steward.dev/owner-uid"
	managedBy     = "app.kubernetes.io/managed-by"
	finalizer     = "tenancy.steward.dev/namespaces"
)

var tenantGVK = schema.GroupVersionKind{Group: group, Version: "v1alpha1", Kind: "Tenant"}

func newTenant() *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(tenantGVK)
	return u
}

type reconciler struct {
	client.Client
	fieldManager string
	ownerRole    string
}

func (r *reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	t := newTenant()
	if err := r.Get(ctx, req.NamespacedName, t); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !t.GetDeletionTimestamp().IsZero() {
		return ctrl.Result{}, r.cleanup(ctx, t)
	}
	if !controllerutil.ContainsFinalizer(t, finalizer) {
		patch := client.MergeFromWithOptions(t.DeepCopy(), client.MergeFromWithOptimisticLock{})
		controllerutil.AddFinalizer(t, finalizer)
		if err := r.Patch(ctx, t, patch); err != nil {
			return ctrl.Result{}, fmt.Errorf("failed to add finalizer: %w", err)
		}
	}
	spec, _, _ := unstructured.NestedMap(t.Object, "spec")
	namespaces, _, _ := unstructured.NestedStringSlice(spec, "namespaces")
	sort.Strings(namespaces)

	owner := ownerRef(t)
	for _, ns := range namespaces {
		for _, obj := range r.build(t, spec, ns) {
			obj.SetLabels(merge(obj.GetLabels(), map[string]string{ownerLabel: string(t.GetUID()), managedBy: r.fieldManager}))
			if obj.GetKind() != "Namespace" {
				obj.SetOwnerReferences(owner)
			}
			if err := r.Apply(ctx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(r.fieldManager), client.ForceOwnership); err != nil {
				return ctrl.Result{}, fmt.Errorf("failed to apply %s %s/%s: %w", obj.GetKind(), obj.GetNamespace(), obj.GetName(), err)
			}
		}
	}
	for _, obj := range r.clusterObjects(t, spec) {
		obj.SetLabels(merge(obj.GetLabels(), map[string]string{ownerLabel: string(t.GetUID()), managedBy: r.fieldManager}))
		obj.SetOwnerReferences(owner)
		if err := r.Apply(ctx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(r.fieldManager), client.ForceOwnership); err != nil {
			return ctrl.Result{}, fmt.Errorf("failed to apply %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	// Prune namespaces the tenant no longer lists (from the cache, as controller-runtime users do).
	owned := namespaceList()
	if err := r.List(ctx, owned, client.MatchingLabels{tenantLabel: t.GetName(), declaredLabel: "true"}); err != nil {
		return ctrl.Result{}, fmt.Errorf("failed to list namespaces: %w", err)
	}
	want := map[string]bool{}
	for _, ns := range namespaces {
		want[ns] = true
	}
	for i := range owned.Items {
		ns := &owned.Items[i]
		ns.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Namespace"))
		if !want[ns.Name] && ns.DeletionTimestamp.IsZero() && ns.Labels[ownerLabel] == string(t.GetUID()) {
			if err := r.Delete(ctx, ns); client.IgnoreNotFound(err) != nil {
				return ctrl.Result{}, fmt.Errorf("failed to delete namespace %s: %w", ns.Name, err)
			}
		}
	}
	return ctrl.Result{}, r.writeStatus(ctx, t, namespaces)
}

// writeStatus applies the status unless it is unchanged (one write per reconcile at most).
func (r *reconciler) writeStatus(ctx context.Context, t *unstructured.Unstructured, namespaces []string) error {
	current, _, _ := unstructured.NestedMap(t.Object, "status")
	phase := "Active"
	if cordoned, _, _ := unstructured.NestedBool(t.Object, "spec", "cordoned"); cordoned {
		phase = "Cordoned"
	}
	now := time.Now().UTC().Format(time.RFC3339)
	ready := map[string]any{
		"type": "Ready", "status": "True", "reason": "Reconciled", "message": "all tenant objects are applied",
		"observedGeneration": t.GetGeneration(), "lastTransitionTime": now,
	}
	if conds, ok := current["conditions"].([]any); ok {
		for _, c := range conds {
			if m, ok := c.(map[string]any); ok && m["type"] == "Ready" && m["status"] == "True" {
				ready["lastTransitionTime"] = m["lastTransitionTime"]
			}
		}
	}
	nsList := make([]any, 0, len(namespaces))
	for _, n := range namespaces {
		nsList = append(nsList, n)
	}
	status := map[string]any{
		"observedGeneration": t.GetGeneration(),
		"phase":              phase,
		"namespaces":         nsList,
		"namespaceCount":     int64(len(namespaces)),
		"conditions":         []any{ready},
	}
	if equality.Semantic.DeepEqual(normalize(current), normalize(status)) {
		return nil
	}
	patch := newTenant()
	patch.SetName(t.GetName())
	patch.Object["status"] = status
	if err := r.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(patch), client.FieldOwner(r.fieldManager), client.ForceOwnership); err != nil {
		return fmt.Errorf("failed to write status: %w", err)
	}
	return nil
}

// normalize makes JSON-decoded and freshly built maps comparable (int64 vs float64 etc.).
func normalize(m map[string]any) string {
	return fmt.Sprintf("%v", m)
}

func (r *reconciler) cleanup(ctx context.Context, t *unstructured.Unstructured) error {
	if !controllerutil.ContainsFinalizer(t, finalizer) {
		return nil
	}
	policy, _, _ := unstructured.NestedString(t.Object, "spec", "deletionPolicy")
	if policy == "Delete" {
		owned := namespaceList()
		if err := r.List(ctx, owned, client.MatchingLabels{tenantLabel: t.GetName()}); err != nil {
			return fmt.Errorf("failed to list namespaces: %w", err)
		}
		for i := range owned.Items {
			owned.Items[i].SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Namespace"))
			if owned.Items[i].DeletionTimestamp.IsZero() {
				if err := r.Delete(ctx, &owned.Items[i]); client.IgnoreNotFound(err) != nil {
					return fmt.Errorf("failed to delete namespace %s: %w", owned.Items[i].Name, err)
				}
			}
		}
	}
	patch := client.MergeFromWithOptions(t.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(t, finalizer)
	if err := r.Patch(ctx, t, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("failed to remove finalizer: %w", err)
	}
	return nil
}

// ownerRef is the controller reference kube-rs' `controller_owner_ref` makes.
func ownerRef(t *unstructured.Unstructured) []metav1.OwnerReference {
	yes := true
	return []metav1.OwnerReference{{
		APIVersion: t.GetAPIVersion(), Kind: t.GetKind(), Name: t.GetName(), UID: t.GetUID(),
		Controller: &yes, BlockOwnerDeletion: &yes,
	}}
}

func namespaceList() *metav1.PartialObjectMetadataList {
	l := &metav1.PartialObjectMetadataList{}
	l.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NamespaceList"))
	return l
}

func merge(a, b map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

func obj(apiVersion, kind, namespace, name, tenant string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": apiVersion, "kind": kind}}
	u.SetName(name)
	if namespace != "" {
		u.SetNamespace(namespace)
	}
	u.SetLabels(map[string]string{tenantLabel: tenant})
	return u
}

func subjects(list []any) []any {
	seen := map[string]bool{}
	out := []any{}
	for _, s := range list {
		m, ok := s.(map[string]any)
		if !ok {
			continue
		}
		kind, _ := m["kind"].(string)
		name, _ := m["name"].(string)
		ns, _ := m["namespace"].(string)
		key := kind + "/" + ns + "/" + name
		if seen[key] {
			continue
		}
		seen[key] = true
		if kind == "ServiceAccount" {
			out = append(out, map[string]any{"kind": kind, "name": name, "namespace": ns})
		} else {
			out = append(out, map[string]any{"kind": kind, "name": name, "apiGroup": "rbac.authorization.k8s.io"})
		}
	}
	return out
}

// build returns the objects of one tenant namespace (as crates/tenant-operator/src/build.rs).
func (r *reconciler) build(t *unstructured.Unstructured, spec map[string]any, ns string) []*unstructured.Unstructured {
	name := t.GetName()
	out := []*unstructured.Unstructured{}

	namespace := obj("v1", "Namespace", "", ns, name)
	l := map[string]string{}
	if md, ok, _ := unstructured.NestedStringMap(spec, "namespaceMetadata", "labels"); ok {
		l = merge(l, md)
	}
	l[tenantLabel] = name
	l[declaredLabel] = "true"
	if c, _, _ := unstructured.NestedBool(spec, "cordoned"); c {
		l[cordonedLabel] = "true"
	}
	if ps, ok, _ := unstructured.NestedString(spec, "podSecurity"); ok {
		l[podSecurity] = ps
	}
	namespace.SetLabels(l)
	if ann, ok, _ := unstructured.NestedStringMap(spec, "namespaceMetadata", "annotations"); ok && len(ann) > 0 {
		namespace.SetAnnotations(ann)
	}
	out = append(out, namespace)

	role := r.ownerRole
	if s, ok, _ := unstructured.NestedString(spec, "ownerClusterRole"); ok {
		role = s
	}
	owners, _, _ := unstructured.NestedSlice(spec, "owners")
	rb := obj("rbac.authorization.k8s.io/v1", "RoleBinding", ns, "tenant-owner-"+role, name)
	rb.Object["roleRef"] = map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role}
	rb.Object["subjects"] = subjects(owners)
	out = append(out, rb)
	extra, _, _ := unstructured.NestedSlice(spec, "additionalRoleBindings")
	byRole := map[string][]any{}
	roles := []string{}
	for _, e := range extra {
		m, _ := e.(map[string]any)
		cr, _ := m["clusterRole"].(string)
		subs, _ := m["subjects"].([]any)
		if _, seen := byRole[cr]; !seen {
			roles = append(roles, cr)
		}
		byRole[cr] = append(byRole[cr], subs...)
	}
	sort.Strings(roles)
	for _, cr := range roles {
		b := obj("rbac.authorization.k8s.io/v1", "RoleBinding", ns, "tenant-"+cr, name)
		b.Object["roleRef"] = map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cr}
		b.Object["subjects"] = subjects(byRole[cr])
		out = append(out, b)
	}

	if hard, ok, _ := unstructured.NestedMap(spec, "resourceQuota", "hard"); ok {
		q := obj("v1", "ResourceQuota", ns, "tenant-quota", name)
		h := map[string]any{}
		for k, v := range hard {
			h[k] = fmt.Sprint(v)
		}
		q.Object["spec"] = map[string]any{"hard": h}
		out = append(out, q)
	}
	if limits, ok, _ := unstructured.NestedSlice(spec, "limitRange", "limits"); ok {
		lr := obj("v1", "LimitRange", ns, "tenant-limits", name)
		items := []any{}
		for _, it := range limits {
			m, _ := it.(map[string]any)
			item := map[string]any{"type": m["type"]}
			for _, k := range []string{"default", "defaultRequest", "max", "min"} {
				if v, ok := m[k].(map[string]any); ok && len(v) > 0 {
					s := map[string]any{}
					for rk, rv := range v {
						s[rk] = fmt.Sprint(rv)
					}
					item[k] = s
				}
			}
			items = append(items, item)
		}
		lr.Object["spec"] = map[string]any{"limits": items}
		out = append(out, lr)
	}
	enabled := true
	if e, ok, _ := unstructured.NestedBool(spec, "networkIsolation", "enabled"); ok {
		enabled = e
	}
	if enabled {
		peers := []any{map[string]any{"namespaceSelector": map[string]any{"matchLabels": map[string]any{tenantLabel: name}}}}
		if allow, ok, _ := unstructured.NestedStringSlice(spec, "networkIsolation", "allowFromNamespaces"); ok && len(allow) > 0 {
			values := []any{}
			for _, a := range allow {
				values = append(values, a)
			}
			peers = append(peers, map[string]any{"namespaceSelector": map[string]any{"matchExpressions": []any{
				map[string]any{"key": "kubernetes.io/metadata.name", "operator": "In", "values": values},
			}}})
		}
		np := obj("networking.k8s.io/v1", "NetworkPolicy", ns, "tenant-isolation", name)
		np.Object["spec"] = map[string]any{
			"podSelector": map[string]any{},
			"policyTypes": []any{"Ingress"},
			"ingress":     []any{map[string]any{"from": peers}},
		}
		out = append(out, np)
	}
	return out
}

// clusterObjects returns the tenant's ClusterRole and ClusterRoleBinding.
func (r *reconciler) clusterObjects(t *unstructured.Unstructured, spec map[string]any) []*unstructured.Unstructured {
	name := group + ":owner:" + t.GetName()
	cr := obj("rbac.authorization.k8s.io/v1", "ClusterRole", "", name, t.GetName())
	cr.Object["rules"] = []any{
		map[string]any{"apiGroups": []any{group}, "resources": []any{"tenants"}, "resourceNames": []any{t.GetName()}, "verbs": []any{"get", "own"}},
		map[string]any{"apiGroups": []any{""}, "resources": []any{"namespaces"}, "verbs": []any{"create"}},
	}
	owners, _, _ := unstructured.NestedSlice(spec, "owners")
	crb := obj("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "", name, t.GetName())
	crb.Object["roleRef"] = map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
	crb.Object["subjects"] = subjects(owners)
	return []*unstructured.Unstructured{cr, crb}
}

func main() {
	var (
		metricsAddr, probeAddr, leNamespace, leID, ownerRole string
		leaderElect                                          bool
		leaseDuration, renewDeadline, retryPeriod            time.Duration
		concurrency, burst                                   int
		qps                                                  float64
	)
	// --kubeconfig is registered by controller-runtime (pkg/client/config) and read by GetConfig.
	flag.BoolVar(&leaderElect, "leader-elect", true, "elect a leader so only one replica reconciles")
	flag.StringVar(&leNamespace, "leader-election-namespace", "default", "namespace of the Lease")
	flag.StringVar(&leID, "leader-election-id", "reference-tenant-controller", "name of the Lease")
	flag.DurationVar(&leaseDuration, "leader-election-lease-duration", 15*time.Second, "lease duration")
	flag.DurationVar(&renewDeadline, "leader-election-renew-deadline", 10*time.Second, "renew deadline")
	flag.DurationVar(&retryPeriod, "leader-election-retry-period", 2*time.Second, "retry period")
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8080", "metrics address (0 disables)")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "probe address")
	flag.IntVar(&concurrency, "concurrency", 8, "maximum concurrent reconciles")
	flag.Float64Var(&qps, "kube-api-qps", -1, "client-side QPS limit (-1: none, controller-runtime's default)")
	flag.IntVar(&burst, "kube-api-burst", 0, "client-side burst")
	flag.StringVar(&ownerRole, "owner-cluster-role", "admin", "ClusterRole of tenant owners by default")
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))
	log := ctrl.Log.WithName("setup")

	cfg, err := ctrl.GetConfig()
	if err != nil {
		log.Error(err, "failed to load kubeconfig")
		os.Exit(1)
	}
	cfg.QPS = float32(qps)
	cfg.Burst = burst

	hasTenant, err := labels.Parse(tenantLabel)
	if err != nil {
		log.Error(err, "failed to parse selector")
		os.Exit(1)
	}
	scoped := cache.ByObject{Label: hasTenant}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Metrics:                       metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress:        probeAddr,
		LeaderElection:                leaderElect,
		LeaderElectionID:              leID,
		LeaderElectionNamespace:       leNamespace,
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 &leaseDuration,
		RenewDeadline:                 &renewDeadline,
		RetryPeriod:                   &retryPeriod,
		// Tenants are unstructured here; read them from the cache as typed objects would be.
		Client: client.Options{Cache: &client.CacheOptions{Unstructured: true}},
		Cache: cache.Options{ByObject: map[client.Object]cache.ByObject{
			&corev1.Namespace{}:           scoped,
			&corev1.ResourceQuota{}:       scoped,
			&corev1.LimitRange{}:          scoped,
			&rbacv1.RoleBinding{}:         scoped,
			&rbacv1.ClusterRole{}:         scoped,
			&rbacv1.ClusterRoleBinding{}:  scoped,
			&networkingv1.NetworkPolicy{}: scoped,
		}},
	})
	if err != nil {
		log.Error(err, "failed to create manager")
		os.Exit(1)
	}
	r := &reconciler{Client: mgr.GetClient(), fieldManager: "reference-tenant-controller", ownerRole: ownerRole}
	// Children map back to their Tenant by the tenant label (namespaces carry no owner reference).
	byLabel := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []ctrl.Request {
		if t := o.GetLabels()[tenantLabel]; t != "" {
			return []ctrl.Request{{NamespacedName: client.ObjectKey{Name: t}}}
		}
		return nil
	})
	err = ctrl.NewControllerManagedBy(mgr).
		For(newTenant()).
		Watches(&corev1.Namespace{}, byLabel, builder.OnlyMetadata).
		Watches(&rbacv1.RoleBinding{}, byLabel).
		Watches(&corev1.ResourceQuota{}, byLabel).
		Watches(&corev1.LimitRange{}, byLabel).
		Watches(&networkingv1.NetworkPolicy{}, byLabel).
		Watches(&rbacv1.ClusterRole{}, byLabel).
		Watches(&rbacv1.ClusterRoleBinding{}, byLabel).
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrency}).
		Named("tenant").
		Complete(r)
	if err != nil {
		log.Error(err, "failed to create controller")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("ping", func(*http.Request) error { return nil }); err != nil {
		log.Error(err, "failed to add healthz")
		os.Exit(1)
	}
	// Ready once every informer has synced (as Steward's /readyz).
	if err := mgr.AddReadyzCheck("caches", func(req *http.Request) error {
		ctx, cancel := context.WithTimeout(req.Context(), 100*time.Millisecond)
		defer cancel()
		if !mgr.GetCache().WaitForCacheSync(ctx) {
			return errors.New("caches not synced")
		}
		return nil
	}); err != nil {
		log.Error(err, "failed to add readyz")
		os.Exit(1)
	}
	log.Info("starting", "qps", cfg.QPS, "burst", cfg.Burst, "concurrency", concurrency)
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		log.Error(err, "manager stopped")
		os.Exit(1)
	}
}

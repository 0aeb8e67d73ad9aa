// Command leader-candidate is a client-go leaderelection candidate on a coordination.k8s.io/v1
// Lease, for Steward's interoperability tests. While it leads, it appends
// "<identity> <unix-nanos> <term>" to a writes log every 100 ms, checking first that it is
// still the leader. SIGTERM or SIGINT releases the Lease (ReleaseOnCancel) and exits.
//
// Usage: leader-candidate <kubeconfig> <namespace> <lease> <identity> <lease-ms> <renew-ms> <retry-ms> <writes-log>
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

func main() {
	if len(os.Args) != 9 {
		fmt.Fprintln(os.Stderr, "usage: leader-candidate <kubeconfig> <namespace> <lease> <identity> <lease-ms> <renew-ms> <retry-ms> <writes-log>")
		os.Exit(2)
	}
	kubeconfig, namespace, leaseName, identity := os.Args[1], os.Args[2], os.Args[3], os.Args[4]
	leaseDuration, renewDeadline, retryPeriod := millis(os.Args[5]), millis(os.Args[6]), millis(os.Args[7])
	writes, err := os.OpenFile(os.Args[8], os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	check(err)
	defer writes.Close()

	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	check(err)
	client, err := kubernetes.NewForConfig(config)
	check(err)

	// mu orders writes before the release: after SIGTERM no write starts.
	var mu sync.Mutex
	stopping := false
	ctx, cancel := context.WithCancel(context.Background())
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		mu.Lock()
		stopping = true
		mu.Unlock()
		cancel()
	}()

	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: leaseName, Namespace: namespace},
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: identity},
	}
	var elector *leaderelection.LeaderElector
	term := 0
	elector, err = leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   leaseDuration,
		RenewDeadline:   renewDeadline,
		RetryPeriod:     retryPeriod,
		ReleaseOnCancel: true,
		Name:            leaseName,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				term++
				fmt.Fprintf(os.Stderr, "%s: became leader (term %d)\n", identity, term)
				ticker := time.NewTicker(100 * time.Millisecond)
				defer ticker.Stop()
				for {
					select {
					case <-ctx.Done():
						return
					case <-ticker.C:
					}
					// Take the time first: a line's time is one at which we verifiably led.
					now := time.Now()
					mu.Lock()
					if !stopping && ctx.Err() == nil && elector.IsLeader() {
						fmt.Fprintf(writes, "%s %d %d\n", identity, now.UnixNano(), term)
					}
					mu.Unlock()
				}
			},
			OnStoppedLeading: func() {
				fmt.Fprintf(os.Stderr, "%s: stopped leading\n", identity)
			},
			// Called when the holder it observes changes, first when it reads the Lease.
			OnNewLeader: func(holder string) {
				fmt.Fprintf(os.Stderr, "%s: observed leader %s\n", identity, holder)
			},
		},
	})
	check(err)
	// leaderelection.RunOrDie is NewLeaderElector + Run; we keep the elector for IsLeader.
	elector.Run(ctx)
	fmt.Fprintf(os.Stderr, "%s: exiting\n", identity)
}

func millis(s string) time.Duration {
	n, err := strconv.Atoi(s)
	check(err)
	return time.Duration(n) * time.Millisecond
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "leader-candidate:", err)
		os.Exit(1)
	}
}
